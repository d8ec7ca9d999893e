"""Logins and CSRF tokens.

- With --admin-user, every action needs a login: a session cookie (`nsqadmin_session`,
  HttpOnly, SameSite=Strict), a random token kept in memory for SESSION_S (a restart logs
  everyone out). With --require-login-for-reads, pages and GET /api/ need it too.
- Every POST (login included) carries a CSRF token equal to the `nsqadmin_csrf` cookie
  (double submit): the form field `csrf`, or the header `X-CSRF-Token` for the JSON API. A
  page of another site can neither read the cookie nor set the header, so it cannot act.
Passwords are compared in constant time; the password file is read once, at start.
"""

from __future__ import annotations

import hmac
import secrets
import time

SESSION_COOKIE = "nsqadmin_session"
CSRF_COOKIE = "nsqadmin_csrf"
SESSION_S = 12 * 3600


class BadPasswordFile(Exception):
    """The file is missing, unreadable or has no password for a user."""


def load_users(users: list[str], path: str) -> dict[str, str]:
    """user -> password from `user:password` lines, or one bare line for every user."""
    if not users:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    except OSError as e:
        raise BadPasswordFile(f"cannot read --admin-password-file {path}: {e.strerror}")
    pairs = dict(ln.split(":", 1) for ln in lines if ":" in ln)
    if len(lines) == 1 and ":" not in lines[0]:
        return {u: lines[0] for u in users}
    missing = [u for u in users if not pairs.get(u)]
    if missing:
        raise BadPasswordFile(f"no password for {', '.join(missing)} in {path}")
    return {u: pairs[u] for u in users}


class Auth:
    def __init__(self, users: dict[str, str], reads_need_login: bool):
        self.users = users
        self.reads_need_login = reads_need_login
        self.sessions: dict[str, tuple[str, float]] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.users)

    def check(self, user: str, password: str) -> bool:
        want = self.users.get(user)
        ok = hmac.compare_digest((want or "\0").encode(), password.encode())
        return want is not None and ok

    def login(self, user: str) -> str:
        token = secrets.token_urlsafe(32)
        now = time.monotonic()
        self.sessions = {k: v for k, v in self.sessions.items() if v[1] > now}
        self.sessions[token] = (user, now + SESSION_S)
        return token

    def logout(self, token: str | None) -> None:
        self.sessions.pop(token or "", None)

    def user(self, request) -> str | None:
        """The logged-in user of the request; "" when logins are off (anyone may act)."""
        if not self.enabled:
            return ""
        entry = self.sessions.get(request.cookies.get(SESSION_COOKIE, ""))
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def may_read(self, request) -> bool:
        return not self.reads_need_login or self.user(request) is not None

    def may_act(self, request) -> bool:
        return self.user(request) is not None


def csrf_token(request) -> tuple[str, bool]:
    """(the browser's CSRF token, True when it is new and must be set as a cookie)."""
    token = request.cookies.get(CSRF_COOKIE, "")
    if len(token) >= 20:
        return token, False
    return secrets.token_urlsafe(24), True


def csrf_ok(request, submitted: str | None) -> bool:
    cookie = request.cookies.get(CSRF_COOKIE, "")
    return bool(cookie) and bool(submitted) and hmac.compare_digest(cookie, submitted)
