"""The HTTP server (port 4171): pages, the /api/ JSON API, static files, login.

aiohttp's web.Application, the stack nsqd and nsqlookupd already serve with. Pages and
/api/ share views.py: a page is views.X rendered by pages.X, /api/X is views.X as JSON.
Middleware order: CSRF cookie, then login for reads (when required), then CSRF check and
login for every POST. Every answer carries `Server-Timing: render;dur=<ms>` (the time this
process spent on it), which the browser test and the bench read.
"""

from __future__ import annotations

import asyncio
import os
import time
from urllib.parse import quote, unquote

from aiohttp import web

from nsqwire import httpapi

from . import actions, api, auth, keys, pages, views
from .actions import ActionError

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
FLASH_COOKIE = "nsqadmin_flash"
FRAGMENT_HEADER = "X-Nsqadmin-Fragment"
OPEN_PATHS = ("/login", "/api/login", "/api/csrf", "/ping", "/favicon.ico")
STATIC_TYPES = {"admin.css": "text/css", "admin.js": "text/javascript",
                "favicon.svg": "image/svg+xml"}


def _is_api(request) -> bool:
    return request.path.startswith("/api/")


def _json_error(status: int, code: str, detail: str = "", **extra) -> web.Response:
    return web.json_response({"message": code, "detail": detail, **extra}, status=status)


def _ctx(request) -> dict:
    a = request.app[keys.AUTH]
    return {"csrf": request[keys.CSRF], "auth": a.enabled, "user": a.user(request),
            "flash": unquote(request.cookies.get(FLASH_COOKIE, "")),
            "refresh": request.app[keys.REFRESH_S]}


def html_page(request, title_main: tuple[str, str], status: int = 200,
              refresh: bool = True) -> web.Response:
    ctx = _ctx(request)
    if not refresh:
        ctx["refresh"] = 0
    title, main = title_main
    if request.headers.get(FRAGMENT_HEADER):
        body = main
    else:
        body = pages.layout(title, main, ctx)
    resp = web.Response(text=body, status=status, content_type="text/html")
    if ctx["flash"]:
        resp.del_cookie(FLASH_COOKIE)
    return resp


def _error(request, status: int, code: str, detail: str) -> web.Response:
    if _is_api(request):
        return _json_error(status, code, detail)
    return html_page(request, pages.error_page(status, code, detail), status, refresh=False)


@web.middleware
async def timing(request, handler):
    started = time.perf_counter()
    try:
        resp = await handler(request)
    except views.NotFound as e:
        resp = _error(request, 404, e.code, e.detail)
    except views.BadQuery as e:
        resp = _error(request, 400, "BAD_QUERY", str(e))
    except ActionError as e:
        resp = _error(request, e.status, e.code, e.detail)
    except web.HTTPException as e:
        if e.status in (404, 405):
            resp = _error(request, e.status, "NOT_FOUND" if e.status == 404
                          else "METHOD_NOT_ALLOWED", e.reason)
        else:
            raise
    resp.headers["Server-Timing"] = f"render;dur={(time.perf_counter() - started) * 1000:.2f}"
    return resp


@web.middleware
async def guard(request, handler):
    """CSRF cookie for every browser; login for reads (when required) and for actions; a
    POST's body read first, within httpapi.BODY_S (else 408 BODY_TIMEOUT)."""
    token, new = auth.csrf_token(request)
    request[keys.CSRF] = token
    a = request.app[keys.AUTH]
    path = request.path
    if request.method == "POST":
        try:
            async with asyncio.timeout(httpapi.BODY_S):
                await request.read()  # kept: post() and read() give it again
        except TimeoutError:
            return _error(request, 408, "BODY_TIMEOUT",
                          f"the request's body did not come within {httpapi.BODY_S:g} s")
        form = {} if _is_api(request) else await request.post()
        request[keys.FORM] = form
        sent = request.headers.get("X-CSRF-Token") or form.get("csrf")
        if not auth.csrf_ok(request, sent):
            resp = _error(request, 403, "BAD_CSRF_TOKEN",
                          "the form's token does not match this browser's (reload the page)")
        elif path not in ("/login", "/api/login") and not a.may_act(request):
            resp = _login_needed(request, "actions need a login")
        else:
            resp = await handler(request)
    elif (not a.may_read(request) and path not in OPEN_PATHS
          and not path.startswith("/static/")):
        resp = _login_needed(request, "this nsqadmin needs a login to read")
    else:
        resp = await handler(request)
    if new:
        resp.set_cookie(auth.CSRF_COOKIE, token, httponly=False, samesite="Strict", path="/")
    return resp


def _login_needed(request, why: str) -> web.Response:
    if _is_api(request):
        return _json_error(401, "LOGIN_REQUIRED", why)
    back = request.path if request.method == "GET" else \
        request.headers.get("Referer", "/").split(request.host, 1)[-1] or "/"
    raise web.HTTPSeeOther(f"/login?next={quote(back)}")


# ---- pages ------------------------------------------------------------------------------

def _source(request):
    return request.app[keys.SOURCE]


async def cluster(request):
    return html_page(request, pages.cluster_page(views.cluster_view(_source(request)),
                                                 _ctx(request)))


async def topics(request):
    return html_page(request, pages.topics_page(views.topics_view(_source(request)),
                                                _ctx(request)))


async def topic(request):
    v = views.topic_view(_source(request), request.match_info["topic"])
    return html_page(request, pages.topic_page(v, _ctx(request)))


async def channel(request):
    v = views.channel_view(_source(request), request.match_info["topic"],
                           request.match_info["channel"])
    return html_page(request, pages.channel_page(v, _ctx(request)))


async def half(request):
    v = await views.half_view(_source(request), request.match_info["topic"])
    return html_page(request, pages.half_page(v, _ctx(request)), refresh=False)


async def dead(request):
    v = await views.dead_view(_source(request), request.match_info["topic"],
                              request.match_info["channel"], dict(request.query))
    return html_page(request, pages.dead_page(v, _ctx(request)), refresh=False)


async def dead_letter(request):
    v = await views.dead_letter_view(_source(request), request.match_info["topic"],
                                     request.match_info["channel"], request.match_info["id"])
    return html_page(request, pages.dead_letter_page(v, _ctx(request)), refresh=False)


async def node(request):
    v = views.node_view(_source(request), request.match_info["node"])
    return html_page(request, pages.node_page(v, _ctx(request)))


async def trace(request):
    raw, ctx = dict(request.query), _ctx(request)
    if not any(raw.get(k) for k in ("msg_id", "trace_id", "topic")):
        error = "give a message id, a trace id, or a topic" if raw else ""
        return html_page(request, pages.trace_page(None, raw, error, ctx), 400 if raw else 200,
                         refresh=False)
    try:
        status, v = await views.trace_view(_source(request), raw)
    except views.BadQuery as e:
        return html_page(request, pages.trace_page(None, raw, str(e), ctx), 400,
                         refresh=False)
    return html_page(request, pages.trace_page(v, raw, "", ctx), status, refresh=False)


async def login_form(request):
    return html_page(request, pages.login_page(_ctx(request), request.query.get("next", "/")),
                     refresh=False)


def _safe_next(url: str) -> str:
    return url if url.startswith("/") and not url.startswith("//") else "/"


async def login(request):
    form = request[keys.FORM]
    a = request.app[keys.AUTH]
    if not a.enabled:
        raise web.HTTPSeeOther("/")
    if not a.check(str(form.get("user", "")), str(form.get("password", ""))):
        return html_page(request, pages.login_page(_ctx(request), form.get("next", "/"),
                                                   "wrong user or password"), 401,
                         refresh=False)
    resp = web.HTTPSeeOther(_safe_next(str(form.get("next", "/"))))
    resp.set_cookie(auth.SESSION_COOKIE, a.login(str(form["user"])), httponly=True,
                    samesite="Strict", path="/", max_age=auth.SESSION_S)
    raise resp


async def logout(request):
    request.app[keys.AUTH].logout(request.cookies.get(auth.SESSION_COOKIE))
    resp = web.HTTPSeeOther("/")
    resp.del_cookie(auth.SESSION_COOKIE, path="/")
    raise resp


def _after(request, outcome: actions.Outcome, where: str):
    resp = web.HTTPSeeOther(where)
    resp.set_cookie(FLASH_COOKIE, quote(outcome.summary()[:300]), path="/", max_age=30)
    raise resp


async def topic_create(request):
    form = request[keys.FORM]
    name = str(form.get("topic", "")).strip()
    out = await actions.topic_action(_source(request), "create", name, form)
    _after(request, out, f"/topics/{pages.u(name)}" if out.ok else "/topics")


async def topic_act(request):
    name, action = request.match_info["topic"], request.match_info["action"]
    form = request[keys.FORM]
    if action == "channel_create":
        ch = str(form.get("channel", "")).strip()
        out = await actions.channel_action(_source(request), "create", name, ch, form)
        _after(request, out, f"/topics/{pages.u(name)}/{pages.u(ch)}" if out.ok
               else f"/topics/{pages.u(name)}")
    out = await actions.topic_action(_source(request), action, name, form)
    if action == "delete" and out.ok:
        _after(request, out, "/topics")
    if action == "tombstone":
        _after(request, out, f"/nodes/{pages.u(str(form.get('node', '')))}")
    if action in ("half_commit", "half_rollback"):
        _after(request, out, f"/topics/{pages.u(name)}/half")
    _after(request, out, f"/topics/{pages.u(name)}")


async def channel_act(request):
    t, c, action = (request.match_info[k] for k in ("topic", "channel", "action"))
    out = await actions.channel_action(_source(request), action, t, c, request[keys.FORM])
    if action == "delete" and out.ok:
        _after(request, out, f"/topics/{pages.u(t)}")
    if action in ("dead_requeue", "dead_purge"):
        _after(request, out, f"/topics/{pages.u(t)}/{pages.u(c)}/dead")
    _after(request, out, f"/topics/{pages.u(t)}/{pages.u(c)}")


async def node_act(request):
    http, action = request.match_info["node"], request.match_info["action"]
    out = await actions.node_action(_source(request), action, http, request[keys.FORM])
    _after(request, out, f"/nodes/{pages.u(http)}")


async def balance(request):
    _after(request, await actions.balance_now(_source(request)), "/cluster")


async def static(request):
    name = request.match_info["name"]
    if name not in STATIC_TYPES:
        raise web.HTTPNotFound()
    return web.FileResponse(os.path.join(STATIC, name), headers={
        "Cache-Control": "max-age=300", "Content-Type": STATIC_TYPES[name]})


async def favicon(request):
    """The icon browsers ask for on their own: the page's SVG icon (no 404 in their logs)."""
    return web.FileResponse(os.path.join(STATIC, "favicon.svg"), headers={
        "Cache-Control": "max-age=86400", "Content-Type": "image/svg+xml"})


async def ping(request):
    return web.Response(text="OK")


def make_runner(app: web.Application) -> web.AppRunner:
    """The app's server: a connection with no whole request for httpapi.IDLE_S is closed (idle, or
    its request line and headers coming that slowly; aiohttp's own timer is an hour)."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=httpapi.IDLE_S)


def make_app(source, a: auth.Auth, refresh_s: float) -> web.Application:
    app = web.Application(middlewares=[timing, guard], client_max_size=64 * 1024)
    app[keys.SOURCE], app[keys.AUTH], app[keys.REFRESH_S] = source, a, refresh_s
    app.router.add_get("/", topics)  # the front page is the topic list, as Go nsqadmin's
    app.router.add_get("/cluster", cluster)
    app.router.add_get("/ping", ping)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_get("/topics", topics)
    app.router.add_post("/topics", topic_create)
    app.router.add_get("/topics/{topic}", topic)
    app.router.add_post("/topics/{topic}/{action}", topic_act)
    # before {channel}: a channel named `half` has no page of its own
    app.router.add_get("/topics/{topic}/half", half)
    app.router.add_get("/topics/{topic}/{channel}", channel)
    app.router.add_post("/topics/{topic}/{channel}/{action}", channel_act)
    app.router.add_get("/topics/{topic}/{channel}/dead", dead)
    app.router.add_get("/topics/{topic}/{channel}/dead/{id}", dead_letter)
    app.router.add_get("/nodes/{node}", node)
    app.router.add_post("/nodes/{node}/{action}", node_act)
    app.router.add_post("/cluster/balance", balance)
    app.router.add_get("/trace", trace)
    app.router.add_get("/login", login_form)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    api.add_routes(app)
    return app
