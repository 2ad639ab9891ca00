"""The app's effective routes, flat: for a 405's ``Allow`` and for authenticating before routing.

FastAPI ≥ 0.16x keeps included routers lazily (``app.routes`` holds one entry per router);
``fastapi.routing.iter_route_contexts`` flattens them. Older releases list every route directly.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

try:  # FastAPI with lazily included routers
    from fastapi.routing import iter_route_contexts as _iter_route_contexts
except ImportError:  # pragma: no cover - older FastAPI: app.routes is already flat
    _iter_route_contexts = None  # type: ignore[assignment]


def route_table(app: FastAPI) -> list[Any]:
    """Every route of ``app`` (objects with ``path_regex``, ``methods``, ``dependencies``)."""
    cached: list[Any] | None = getattr(app.state, "route_table", None)
    if cached is None:
        routes = list(app.routes)
        cached = list(_iter_route_contexts(routes)) if _iter_route_contexts is not None else routes
        app.state.route_table = cached
    return cached


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route of ``app`` accepts on ``path``, sorted."""
    methods: set[str] = set()
    for route in route_table(app):
        route_methods = getattr(route, "methods", None)
        regex = getattr(route, "path_regex", None)
        if route_methods and regex is not None and regex.match(path):
            methods |= set(route_methods)
    return sorted(methods)


def matching_route(app: FastAPI, path: str, method: str) -> Any | None:
    """The first route of ``app`` that accepts ``method`` on ``path`` (routing order), or None."""
    for route in route_table(app):
        route_methods = getattr(route, "methods", None)
        regex = getattr(route, "path_regex", None)
        if route_methods and method in route_methods and regex is not None and regex.match(path):
            return route
    return None
