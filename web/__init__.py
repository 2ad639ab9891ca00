"""The operator dashboard: Jinja2 templates, static assets and read-only queries.

Served by the API app (``api.routers.dashboard``); it reads through the same services and
database sessions as the REST API, never through HTTP calls to itself.
"""
