"""The operator dashboard's rendering: Jinja2 templates, static assets, charts and diagrams.

Served by the API app (``api.routers.dashboard``), which reads through the same services and
database sessions as the REST API (never through HTTP calls to itself) and hands the results to
these modules. They import nothing of ``api``: the server imports the dashboard, not the reverse.
"""
