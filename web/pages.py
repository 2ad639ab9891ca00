"""The dashboard's page renderer: the Jinja2 templates of ``web/templates`` with the filters of
:mod:`web.format`, and where the static files are served.

The dashboard routes (:mod:`api.routers.dashboard`) and the login and refusal pages of
:mod:`api.auth` render through this one environment; it imports neither of them.
"""

from __future__ import annotations

from pathlib import Path

from fastapi.templating import Jinja2Templates

from web.format import FILTERS

# Templates and static files sit in this package (in the checkout and in an installed wheel alike).
WEB_DIR = Path(__file__).resolve().parent
STATIC_DIR = WEB_DIR / "static"
STATIC_URL = "/ui/static"
POLL_S = 3

templates = Jinja2Templates(directory=str(WEB_DIR / "templates"))
templates.env.filters.update(FILTERS)
templates.env.globals.update(static=STATIC_URL, poll_s=POLL_S)
