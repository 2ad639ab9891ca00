"""The dashboard's cookie names: the login session's (set by :mod:`api.auth`) and the CSRF
nonce's (:mod:`api.csrf`, whose token is bound to the session cookie too)."""

SESSION_COOKIE = "kvplane_session"
CSRF_COOKIE = "kvplane_csrf"
