"""What nsqadmin's aiohttp app and each of its requests carry, as typed keys (aiohttp's
AppKey and RequestKey): the app's data source, its logins and its pages' refresh period;
a request's CSRF token and, for a POST, its form (guard in app.py sets both first)."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from .auth import Auth
from .source import Source

SOURCE = web.AppKey("source", Source)
AUTH = web.AppKey("auth", Auth)
REFRESH_S = web.AppKey("refresh_s", float)
CSRF = web.RequestKey("csrf", str)
FORM = web.RequestKey("form", Mapping)  # a POST body's fields: {} for the JSON API
