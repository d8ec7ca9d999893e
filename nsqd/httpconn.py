"""The HTTP server's connections: aiohttp's, with two things Go's net/http does that
aiohttp does not.

- A half-close ends what the client sends, not what it reads. asyncio closes a
  connection at EOF unless its protocol says otherwise, which dropped the answer to a
  request whose client had half-closed. Here a body cut short by the half-close fails
  its read (400 `BAD_BODY` in http.py), and the request in progress, or the next one
  already received, is answered before the connection closes; requests pipelined
  behind that one are not.
- A malformed request (aiohttp's parser refuses it with a plain-text 400, as Go's
  net/http does) costs one `http_bad_request` log line, never a traceback: a client
  must not be able to fill the log cheaply.

A connection with no whole request for nsqwire.httpapi.IDLE_S is closed: idle between
requests, or a request's line and headers arriving too slowly (aiohttp's keepalive timer
covers both; at its default, an hour, a client that sends half a request would hold a
descriptor that long).

`cut(request)` ends a chunked answer early (/metrics, /read) so that its reader sees an
error, never a shorter answer that looks whole.
"""

from __future__ import annotations

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, PayloadEncodingError
from aiohttp.web_protocol import RequestHandler

from nsqwire import httpapi

log = structlog.get_logger("nsqd.http")


class Connection(RequestHandler):
    """aiohttp's HTTP/1.1 connection, with a client's half-close and malformed requests
    handled as the module docstring says. (It leans on aiohttp 3's connection internals,
    `_messages` and `_close`; tests/test_http.py pins the behaviour.)"""

    received: web.BaseRequest | None = None  # the request made last (see Server)
    answered = True  # ... and whether its answer went out

    def eof_received(self) -> bool:
        waiting = [payload for _, payload in self._messages]
        if not self.answered:
            waiting.append(self.received.content)
        if not waiting:
            return False  # nothing to answer: close
        for payload in waiting:
            if not payload.is_eof():
                payload.set_exception(PayloadEncodingError(
                    "the client closed its side before the end of the body"))
        self._close = True  # answer, then close (aiohttp's close() would drop the answer)
        return True  # keep the transport open for writing

    async def finish_response(self, request, resp, start_time):
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.answered = True

    def log_exception(self, message: str, *args, exc_info=None, **kw) -> None:
        """aiohttp's own reports, above all a parser's refusal: one line, no traceback."""
        event = ("http_bad_request" if isinstance(exc_info, HttpProcessingError)
                 else "http_server_error")
        if isinstance(exc_info, BaseException):
            text = getattr(exc_info, "message", None) or str(exc_info)
            error = f"{type(exc_info).__name__}: {' '.join(str(text).split())}"[:200]
        else:
            error = message % args
        log.warning(event, error=error)


class Server(web.Server):
    """aiohttp's low-level server, making a Connection per client (closed when idle for
    httpapi.IDLE_S)."""

    def __call__(self) -> RequestHandler:
        return Connection(self, loop=self._loop, keepalive_timeout=httpapi.IDLE_S,
                          **self._kwargs)

    def _make_request(self, message, payload, protocol, writer, task) -> web.BaseRequest:
        request = super()._make_request(message, payload, protocol, writer, task)
        protocol.received, protocol.answered = request, False
        return request


def cut(request: web.BaseRequest, stalled: bool = False) -> None:
    """End a chunked answer early: the connection closes without the last chunk, so the
    reader sees an error, never a shorter answer that looks whole (a no-op once the
    connection is gone). A `stalled` reader (one that took nothing within its deadline) is
    dropped at once: a close waits until what is buffered is taken, which a reader that
    takes nothing never lets happen."""
    if request.transport is not None:
        if stalled:
            request.transport.abort()
        else:
            request.transport.close()
