"""The HTTP API (port 4161): Go nsqlookupd v1.3.0's, with its envelopes and errors.

    GET  /ping                     OK (text)
    GET  /info                     {"version"}
    GET  /lookup?topic=            {"channels", "producers"}; 400 MISSING_ARG_TOPIC,
                                   404 TOPIC_NOT_FOUND
    GET  /topics                   {"topics"}
    GET  /channels?topic=          {"channels"}; 400 MISSING_ARG_TOPIC
    GET  /nodes                    {"producers": [... "tombstones", "topics"]}
    POST /topic/create?topic=      400 MISSING_ARG_TOPIC, INVALID_ARG_TOPIC
    POST /topic/delete?topic=      400 MISSING_ARG_TOPIC (an unknown topic is no error)
    POST /channel/create?topic=&channel=   400 MISSING_ARG_*/INVALID_ARG_*
    POST /channel/delete?topic=&channel=   ... and 404 CHANNEL_NOT_FOUND
    POST /topic/tombstone?topic=&node=<broadcast_address>:<http_port>
                                   400 MISSING_ARG_TOPIC, MISSING_ARG_NODE

Answers are V1's: JSON (`application/json; charset=utf-8`, compact, `<>&` escaped as Go
does) with `X-NSQ-Content-Type: nsq; version=1.0`, errors `{"message": "CODE"}` with the
status; an unparsable query is 400 INVALID_REQUEST; an unknown path 404 NOT_FOUND and a
known path with another method 405 METHOD_NOT_ALLOWED with `Allow`. v1.3.0 has no GET
forms of the POST actions (they are 405 there too). Any bug is 500 INTERNAL_ERROR, logged.

With `--admin-secret-file` every route but a GET (in either mode) needs
`Authorization: Bearer <secret>` (nsqwire/adminkey.py: 401 ADMIN_KEY_REQUIRED, 403
ADMIN_KEY_INVALID), checked after routing and before the handler, so a refused call
changes nothing. A GET handler must not change state.

The handlers read and change the registrations only through the `directory` given to
start_http (in classic mode the RegistrationDB fed by nsqd over TCP). Requests are routed
through `lookupd.routes`: ROUTES here, or cluster_http.ROUTES in cluster mode, which keeps
the read handlers of /topics and /channels and brings its own for the rest; in both modes
with tracesearch.ROUTES (the cluster-wide /trace/search and /message/get).

Every request has an end: nsqwire.httpapi's IDLE_S for a whole request on a connection,
BODY_S for a body (408 BODY_TIMEOUT).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from nsqwire import adminkey, httpapi
from nsqwire.httpapi import V1_HEADER, parse_query, v1_answer
from nsqwire.protocol import valid_channel_name, valid_topic_name

log = structlog.get_logger("nsqlookupd.http")


class HTTPError(Exception):
    """An answer `{"message": code}` with an HTTP status (cluster mode adds `extra` keys,
    such as the master's address beside NOT_MASTER)."""

    def __init__(self, status: int, code: str, **extra):
        super().__init__(code)
        self.status = status
        self.code = code
        self.extra = extra


def respond(status: int, data, extra: dict | None = None) -> web.Response:
    """Go's http_api V1 decorator (nsqwire.httpapi.v1_answer); bytes are JSON encoded
    already (cluster mode's cached /lookup answers)."""
    body, content_type = v1_answer(status, data, extra)
    if content_type is None:
        return web.Response(status=status, headers=V1_HEADER)
    return web.Response(status=status, body=body, content_type=content_type, charset="utf-8",
                        headers=V1_HEADER)


def _query(request: web.BaseRequest) -> dict[str, list[str]]:
    try:
        return parse_query(request.rel_url.raw_query_string)
    except ValueError:
        raise HTTPError(400, "INVALID_REQUEST") from None


def _arg(params: dict, name: str, missing: str) -> str:
    values = params.get(name)
    if not values:
        raise HTTPError(400, missing)
    return values[0]


def _topic_channel(params: dict) -> tuple[str, str]:
    """http_api.GetTopicChannelArgs."""
    topic = _arg(params, "topic", "MISSING_ARG_TOPIC")
    if not valid_topic_name(topic):
        raise HTTPError(400, "INVALID_ARG_TOPIC")
    channel = _arg(params, "channel", "MISSING_ARG_CHANNEL")
    if not valid_channel_name(channel):
        raise HTTPError(400, "INVALID_ARG_CHANNEL")
    return topic, channel


# ---- handlers: (lookupd, params) -> str | None | JSON data; errors raise HTTPError ----


def do_info(lookupd, params):
    return {"version": lookupd.version}


def do_lookup(lookupd, params):
    topic = _arg(params, "topic", "MISSING_ARG_TOPIC")
    d = lookupd.directory
    if not d.has_topic(topic):
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    return {"channels": d.channels(topic), "producers": d.producers(topic, time.time())}


def do_topics(lookupd, params):
    return {"topics": lookupd.directory.topics()}


def do_channels(lookupd, params):
    return {"channels": lookupd.directory.channels(_arg(params, "topic", "MISSING_ARG_TOPIC"))}


def do_nodes(lookupd, params):
    return {"producers": lookupd.directory.nodes(time.time())}


def do_topic_create(lookupd, params):
    topic = _arg(params, "topic", "MISSING_ARG_TOPIC")
    if not valid_topic_name(topic):
        raise HTTPError(400, "INVALID_ARG_TOPIC")
    log.info("topic_created", topic=topic)
    lookupd.directory.create_topic(topic)


def do_topic_delete(lookupd, params):
    topic = _arg(params, "topic", "MISSING_ARG_TOPIC")
    log.info("topic_deleted", topic=topic)
    lookupd.directory.delete_topic(topic)


def do_channel_create(lookupd, params):
    topic, channel = _topic_channel(params)
    log.info("channel_created", topic=topic, channel=channel)
    lookupd.directory.create_channel(topic, channel)


def do_channel_delete(lookupd, params):
    topic, channel = _topic_channel(params)
    if not lookupd.directory.delete_channel(topic, channel):
        raise HTTPError(404, "CHANNEL_NOT_FOUND")
    log.info("channel_deleted", topic=topic, channel=channel)


def do_topic_tombstone(lookupd, params):
    topic = _arg(params, "topic", "MISSING_ARG_TOPIC")
    node = _arg(params, "node", "MISSING_ARG_NODE")
    log.info("topic_tombstoned", topic=topic, node=node)
    lookupd.directory.tombstone(topic, node, time.time())


ROUTES = {
    "/ping": {"GET": None},
    "/info": {"GET": do_info},
    "/lookup": {"GET": do_lookup},
    "/topics": {"GET": do_topics},
    "/channels": {"GET": do_channels},
    "/nodes": {"GET": do_nodes},
    "/topic/create": {"POST": do_topic_create},
    "/topic/delete": {"POST": do_topic_delete},
    "/topic/tombstone": {"POST": do_topic_tombstone},
    "/channel/create": {"POST": do_channel_create},
    "/channel/delete": {"POST": do_channel_delete},
}


async def dispatch(lookupd, request: web.BaseRequest) -> web.StreamResponse:
    """Route through `lookupd.routes` (ROUTES, or cluster mode's); a handler may be async."""
    path = request.path
    methods = lookupd.routes.get(path)
    if methods is None:
        return respond(404, "NOT_FOUND")
    allow = ", ".join(sorted((*methods, "OPTIONS")))
    if request.method == "OPTIONS":
        return web.Response(status=200, headers={"Allow": allow})
    if request.method not in methods:
        resp = respond(405, "METHOD_NOT_ALLOWED")
        resp.headers["Allow"] = allow
        return resp
    if path == "/ping":  # Go's PlainText decorator: no V1 header
        return web.Response(text="OK")
    refused = adminkey.refusal(lookupd.admin_secret, request.method, path,
                               request.headers.get(adminkey.HEADER))
    if refused is not None:
        return respond(*refused)
    try:
        handler = methods[request.method]
        args = (lookupd, _query(request))
        if getattr(handler, "takes_body", 0):  # at most that many bytes (setoffset.py)
            try:
                async with asyncio.timeout(httpapi.BODY_S):
                    args += (await request.content.read(handler.takes_body),)
            except TimeoutError:
                return respond(408, "BODY_TIMEOUT")
        data = handler(*args)
        if inspect.isawaitable(data):
            data = await data
    except HTTPError as e:
        return respond(e.status, e.code, e.extra)
    except Exception:  # a bug costs one request, never the server
        log.exception("http_handler_failed", path=path, method=request.method)
        return respond(500, "INTERNAL_ERROR")
    return respond(200, data)


class _Connection(RequestHandler):
    """aiohttp's connection, with two things Go's net/http does that aiohttp does not:
    its own reports (above all a parser's refusal of a malformed request, answered 400)
    are one log line, never a traceback, so a client cannot fill the log cheaply; and a
    client's half-close ends what it sends, not what it reads (`printf 'GET /ping ...' |
    nc` gets its answer). Leans on aiohttp 3's `_messages` and `_close`;
    tests/test_nsqlookupd.py pins both."""

    answered = True  # whether the request made last (see _Server) has been answered

    def eof_received(self) -> bool:
        """Answer the request received (the first one, when several are pipelined), then
        close; with none received, close now."""
        if not self._messages and self.answered:
            return False
        self._close = True  # aiohttp's close() would drop the answer
        return True  # keep the transport open for writing

    async def finish_response(self, request, resp, start_time):
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.answered = True

    def log_exception(self, message: str, *args, exc_info=None, **kw) -> None:
        if isinstance(exc_info, BaseException):
            error = f"{type(exc_info).__name__}: {' '.join(str(exc_info).split())}"[:200]
        else:
            error = message % args
        log.warning("http_bad_request" if isinstance(exc_info, HttpProcessingError)
                    else "http_server_error", error=error)


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, keepalive_timeout=httpapi.IDLE_S,
                           **self._kwargs)

    def _make_request(self, message, payload, protocol, writer, task) -> web.BaseRequest:
        request = super()._make_request(message, payload, protocol, writer, task)
        protocol.answered = False
        return request


async def start_http(lookupd):
    runner = web.ServerRunner(_Server(functools.partial(dispatch, lookupd), access_log=None))
    await runner.setup()
    host, port = lookupd.options.http_host_port
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
