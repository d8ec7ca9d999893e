"""The JSON API under /api/ (documented in nsqadmin/README.md): the views.py dicts the
pages render, and the same actions. Errors are 4xx/5xx `{"message": CODE, "detail": text}`.

POSTs need the `X-CSRF-Token` header equal to the `nsqadmin_csrf` cookie (GET /api/csrf
gives both), and a session when --admin-user is set (POST /api/login). Arguments of a POST
are taken from the query string and from a JSON object body, the body winning.
"""

from __future__ import annotations

import json

from aiohttp import web

from . import actions, auth, keys, views


async def _args(request) -> dict:
    args = dict(request.query)
    if request.body_exists:
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            raise actions.ActionError(400, "BAD_JSON", "the body is not JSON") from None
        if not isinstance(body, dict):
            raise actions.ActionError(400, "BAD_JSON", "the body must be a JSON object")
        args.update({k: str(v) for k, v in body.items()})
    return args


def _source(request):
    return request.app[keys.SOURCE]


async def cluster(request):
    return web.json_response(views.cluster_view(_source(request)))


async def topics(request):
    return web.json_response(views.topics_view(_source(request)))


async def topic(request):
    return web.json_response(views.topic_view(_source(request), request.match_info["topic"]))


async def channel(request):
    return web.json_response(views.channel_view(_source(request), request.match_info["topic"],
                                                request.match_info["channel"]))


async def half(request):
    return web.json_response(await views.half_view(_source(request),
                                                   request.match_info["topic"]))


async def dead(request):
    return web.json_response(await views.dead_view(
        _source(request), request.match_info["topic"], request.match_info["channel"],
        dict(request.query)))


async def dead_letter(request):
    return web.json_response(await views.dead_letter_view(
        _source(request), request.match_info["topic"], request.match_info["channel"],
        request.match_info["id"]))


async def node(request):
    return web.json_response(views.node_view(_source(request), request.match_info["node"]))


async def trace(request):
    status, v = await views.trace_view(_source(request), dict(request.query))
    return web.json_response(v, status=status)


async def message(request):
    q = {k: request.query[k] for k in ("topic", "partition", "msg_id", "offset")
         if request.query.get(k)}
    if "topic" not in q:
        raise views.BadQuery("topic is required")
    status, body = await _source(request).message_get(q)
    if status == 200:
        body = {**body, **views.body_view(body)}
    return web.json_response(body, status=status)


def _outcome(out: actions.Outcome) -> web.Response:
    return web.json_response(out.as_dict(), status=200 if out.ok else 502)


async def topic_create(request):
    args = await _args(request)
    return _outcome(await actions.topic_action(_source(request), "create",
                                               args.get("topic", ""), args))


async def topic_act(request):
    args = await _args(request)
    name, action = request.match_info["topic"], request.match_info["action"]
    if action == "channel_create":
        return _outcome(await actions.channel_action(_source(request), "create", name,
                                                     args.get("channel", ""), args))
    return _outcome(await actions.topic_action(_source(request), action, name, args))


async def channel_act(request):
    args = await _args(request)
    t, c, action = (request.match_info[k] for k in ("topic", "channel", "action"))
    return _outcome(await actions.channel_action(_source(request), action, t, c, args))


async def node_act(request):
    args = await _args(request)
    return _outcome(await actions.node_action(_source(request), request.match_info["action"],
                                              request.match_info["node"], args))


async def balance(request):
    return _outcome(await actions.balance_now(_source(request)))


async def csrf(request):
    return web.json_response({"csrf": request[keys.CSRF], "cookie": auth.CSRF_COOKIE,
                              "header": "X-CSRF-Token"})


async def login(request):
    args = await _args(request)
    a = request.app[keys.AUTH]
    if not a.enabled:
        return web.json_response({"message": "LOGIN_NOT_ENABLED",
                                  "detail": "no --admin-user: anyone may act"}, status=400)
    if not a.check(args.get("user", ""), args.get("password", "")):
        return web.json_response({"message": "BAD_LOGIN", "detail": "wrong user or password"},
                                 status=401)
    resp = web.json_response({"user": args["user"]})
    resp.set_cookie(auth.SESSION_COOKIE, a.login(args["user"]), httponly=True,
                    samesite="Strict", path="/", max_age=auth.SESSION_S)
    return resp


async def logout(request):
    request.app[keys.AUTH].logout(request.cookies.get(auth.SESSION_COOKIE))
    resp = web.json_response({"ok": True})
    resp.del_cookie(auth.SESSION_COOKIE, path="/")
    return resp


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/api/cluster", cluster)
    r.add_get("/api/topics", topics)
    r.add_post("/api/topics", topic_create)
    r.add_get("/api/topics/{topic}", topic)
    # before {channel}: a channel named `half` has no page of its own
    r.add_get("/api/topics/{topic}/half", half)
    r.add_post("/api/topics/{topic}/{action}", topic_act)
    r.add_get("/api/topics/{topic}/{channel}", channel)
    r.add_post("/api/topics/{topic}/{channel}/{action}", channel_act)
    r.add_get("/api/topics/{topic}/{channel}/dead", dead)
    r.add_get("/api/topics/{topic}/{channel}/dead/{id}", dead_letter)
    r.add_get("/api/nodes/{node}", node)
    r.add_post("/api/nodes/{node}/{action}", node_act)
    r.add_post("/api/cluster/balance", balance)
    r.add_get("/api/trace", trace)
    r.add_get("/api/message", message)
    r.add_get("/api/csrf", csrf)
    r.add_post("/api/login", login)
    r.add_post("/api/logout", logout)
