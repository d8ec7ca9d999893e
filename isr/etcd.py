"""An asyncio facade over etcd3gw (etcd's v3 JSON gateway): every call runs in a small
thread pool of its own, never on the event loop, bounded by a request timeout, and
fails with a typed error.

- `EtcdUnavailable`: no endpoint answered in time (etcd down, no quorum): retry later.
- `LeaseGone`: the lease named in the call has expired or was revoked.
- `EtcdRefused`: etcd answered with an error (too many operations in a transaction...).

Reads return etcd's revision with the values; `replace` is the compare-and-swap on a
key's mod_revision, `create` the put-if-absent. With several endpoints a call that finds
one unavailable moves to the next for the calls after it.

Watches (`watch_prefix`) read the gateway's stream themselves, in one thread each: etcd3gw's
`watch_prefix` drops the end of its stream (its iterator blocks forever once etcd goes
away) and etcd's compaction notice, and `watch_prefix_once` matches keys outside the
prefix. A `Watch` resumes after etcd comes back from the revision after the last event
it delivered, so no event is lost or repeated; when etcd no longer has that history
(compacted), or the consumer falls more than `max_pending` events behind, iterating
raises `WatchLost`: read everything again and start a new watch after that read.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar
from urllib.parse import urlsplit

import etcd3gw
import requests
import structlog
from etcd3gw import exceptions as gw

log = structlog.get_logger("isr.etcd")
T = TypeVar("T")


class EtcdError(Exception):
    """Base of the errors of this facade."""


class EtcdUnavailable(EtcdError):
    """No etcd endpoint answered in time."""


class EtcdRefused(EtcdError):
    """etcd answered the request with an error."""


class LeaseGone(EtcdRefused):
    """The lease has expired or was revoked."""


class WatchLost(EtcdError):
    """The watch cannot go on without a gap: read everything again, then watch anew."""


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def prefix_end(prefix: str) -> str:
    """The first key after every key that starts with `prefix` (ASCII prefixes only)."""
    raw = prefix.encode()
    if not raw or raw[-1] >= 0x7F:
        raise ValueError(f"prefix {prefix!r} must end in an ASCII character below 0x7f")
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


@dataclass(frozen=True)
class KeyValue:
    """A key as etcd holds it; `lease` 0 when it has none."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int = 0
    version: int = 0
    lease: int = 0

    @classmethod
    def from_json(cls, kv: dict) -> "KeyValue":
        return cls(key=_unb64(kv["key"]).decode("utf-8", "replace"),
                   value=_unb64(kv.get("value", "")),
                   mod_revision=int(kv.get("mod_revision", 0)),
                   create_revision=int(kv.get("create_revision", 0)),
                   version=int(kv.get("version", 0)), lease=int(kv.get("lease", 0)))


@dataclass(frozen=True)
class WatchEvent:
    """A put or a delete; for a delete `kv.value` is empty and `kv.mod_revision` is the
    revision of the delete."""

    type: str  # "put" | "delete"
    kv: KeyValue


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, str, int]]:
    """`http://h:p,h2:p2` or a list of them -> [(scheme, host, port)]; ValueError if bad."""
    if isinstance(endpoints, str):
        endpoints = [e for e in endpoints.split(",") if e.strip()]
    out = []
    for e in endpoints:
        e = e.strip()
        url = urlsplit(e if "://" in e else "http://" + e)
        if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/"):
            raise ValueError(f"bad etcd endpoint {e!r}: http://host:port")
        try:
            port = url.port or 2379
        except ValueError:
            raise ValueError(f"bad etcd endpoint {e!r}: bad port") from None
        out.append((url.scheme, url.hostname, port))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


class Etcd:
    """The asyncio client. Cheap calls, all bounded by `timeout` seconds each."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout: float = 3.0,
                 workers: int = 4, watch_idle_timeout: float = 30.0):
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self.watch_idle_timeout = watch_idle_timeout
        self._clients = [etcd3gw.Etcd3Client(host=h, port=p, protocol=s, timeout=timeout,
                                             api_path="/v3/")
                         for s, h, p in self.endpoints]
        self._current = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="etcd")
        self._watches: set[Watch] = set()
        self._closed = False

    @property
    def endpoint(self) -> str:
        s, h, p = self.endpoints[self._current]
        return f"{s}://{h}:{p}"

    async def close(self) -> None:
        """Stop the watches and the pool (calls in flight end at their timeout)."""
        self._closed = True
        for w in list(self._watches):
            w.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self._clients:
            c.session.close()

    async def _call(self, fn: Callable[[etcd3gw.Etcd3Client], T]) -> T:
        if self._closed:
            raise EtcdUnavailable("the etcd client is closed")
        index = self._current
        client = self._clients[index]
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, _translated, fn, client)
        except EtcdUnavailable:
            if self._current == index:
                self._current = (index + 1) % len(self._clients)
            raise

    # -- keys ------------------------------------------------------------------------

    async def get(self, key: str) -> tuple[KeyValue | None, int]:
        """The key (None if absent) and the revision of the read."""
        kvs, revision = await self._range(key, None)
        return (kvs[0] if kvs else None), revision

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, sorted by key, and the revision of the read (one
        consistent snapshot)."""
        return await self._range(prefix, prefix_end(prefix))

    async def _range(self, key: str, range_end: str | None) -> tuple[list[KeyValue], int]:
        payload = {"key": _b64(key), "sort_order": 1, "sort_target": 0}
        if range_end is not None:
            payload["range_end"] = _b64(range_end)

        def call(c):
            return c.post(c.get_url("/kv/range"), json=payload)

        result = await self._call(call)
        return ([KeyValue.from_json(kv) for kv in result.get("kvs", [])],
                int(result["header"]["revision"]))

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write the key; returns the new revision."""
        payload: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            payload["lease"] = lease
        result = await self._call(lambda c: c.post(c.get_url("/kv/put"), json=payload))
        return int(result["header"]["revision"])

    async def create(self, key: str, value: bytes, lease: int = 0) -> int | None:
        """Put the key only if it is absent: the new revision, or None if it exists."""
        return await self.replace(key, value, 0, lease)

    async def replace(self, key: str, value: bytes, mod_revision: int,
                      lease: int = 0) -> int | None:
        """Compare-and-swap: put only if the key's mod_revision is still `mod_revision`
        (0: the key must be absent). The new revision, or None on a conflict."""
        if mod_revision == 0:
            compare = [{"key": _b64(key), "target": "CREATE", "result": "EQUAL",
                        "create_revision": 0}]
        else:
            compare = [{"key": _b64(key), "target": "MOD", "result": "EQUAL",
                        "mod_revision": mod_revision}]
        ok, revision = await self.txn(compare, [put_op(key, value, lease)])
        return revision if ok else None

    async def txn(self, compare: list[dict], success: list[dict],
                  failure: Sequence[dict] = ()) -> tuple[bool, int]:
        """One transaction in etcd's JSON form (see `put_op`, `delete_op`, `absent`,
        `unchanged`): (succeeded, revision after it)."""
        body = {"compare": compare, "success": list(success), "failure": list(failure)}
        result = await self._call(lambda c: c.transaction(body))
        return bool(result.get("succeeded", False)), int(result["header"]["revision"])

    async def delete(self, key: str) -> int:
        """Delete the key: how many keys were deleted (0 or 1)."""
        return await self._delete(key, None)

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix` in one revision: how many."""
        return await self._delete(prefix, prefix_end(prefix))

    async def _delete(self, key: str, range_end: str | None) -> int:
        payload = {"key": _b64(key)}
        if range_end is not None:
            payload["range_end"] = _b64(range_end)
        result = await self._call(lambda c: c.post(c.get_url("/kv/deleterange"), json=payload))
        return int(result.get("deleted", 0))

    # -- leases ----------------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds: its id."""
        if type(ttl) is not int or ttl < 1:
            raise ValueError(f"lease ttl {ttl!r}: a whole number of seconds >= 1")
        return (await self._call(lambda c: c.lease(ttl))).id

    async def refresh(self, lease: int) -> int:
        """Keep the lease alive: its new TTL. Raises LeaseGone if it expired."""
        ttl = await self._call(lambda c: etcd3gw.Lease(lease, c).refresh())
        if ttl <= 0:
            raise LeaseGone(f"lease {lease:x} expired")
        return ttl

    async def revoke(self, lease: int) -> None:
        """End the lease now: every key under it is deleted. A gone lease is no error."""
        try:
            await self._call(lambda c: etcd3gw.Lease(lease, c).revoke())
        except LeaseGone:
            pass

    # -- watches ---------------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int = 0,
                     max_pending: int = 10_000) -> "Watch":
        """Events under `prefix` from `start_revision` (0: from now), as an async iterator."""
        return self.watch(prefix, prefix_end(prefix), start_revision, max_pending)

    def watch(self, key: str, range_end: str | None = None, start_revision: int = 0,
              max_pending: int = 10_000) -> "Watch":
        """Events of one key (or of [key, range_end)); close() ends it."""
        w = Watch(self, key, range_end, start_revision, max_pending)
        self._watches.add(w)
        return w


def put_op(key: str, value: bytes, lease: int = 0) -> dict:
    op: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        op["lease"] = lease
    return {"request_put": op}


def delete_op(key: str, range_end: str | None = None) -> dict:
    op = {"key": _b64(key)}
    if range_end is not None:
        op["range_end"] = _b64(range_end)
    return {"request_delete_range": op}


def absent(key: str) -> dict:
    """A transaction compare: the key does not exist."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": 0}


def exists(key: str) -> dict:
    """A transaction compare: the key exists."""
    return {"key": _b64(key), "target": "CREATE", "result": "GREATER", "create_revision": 0}


def value_is(key: str, value: bytes) -> dict:
    """A transaction compare: the key exists and holds `value`."""
    return {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)}


def unchanged(key: str, mod_revision: int) -> dict:
    """A transaction compare: the key's mod_revision is still `mod_revision`."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}


def _translated(fn: Callable[[etcd3gw.Etcd3Client], T], client: etcd3gw.Etcd3Client) -> T:
    """Run one etcd3gw call (in a pool thread), its failures as this module's errors."""
    try:
        return fn(client)
    except (gw.ConnectionFailedError, gw.ConnectionTimeoutError, gw.InternalServerError) as e:
        raise EtcdUnavailable(f"etcd at {client.base_url}: {_detail(e)}") from None
    except gw.Etcd3Exception as e:
        detail = _detail(e)
        if "lease not found" in detail:
            raise LeaseGone(detail) from None
        raise EtcdRefused(f"etcd at {client.base_url}: {detail}") from None
    except requests.RequestException as e:
        raise EtcdUnavailable(f"etcd at {client.base_url}: {e}") from None
    except (ValueError, KeyError, TypeError) as e:  # an answer that is not etcd's JSON
        raise EtcdRefused(f"etcd at {client.base_url}: bad answer ({e!r})") from None


def _detail(e: gw.Etcd3Exception) -> str:
    text = e.detail_text or str(e) or type(e).__name__
    try:
        body = json.loads(text)
        text = body.get("error") or body.get("message") or text
    except (ValueError, AttributeError):
        pass
    return str(text)[:300]


_END = object()
_JSON = json.JSONDecoder()
_MAX_MESSAGE = 64 << 20


class _Compacted(Exception):
    pass


class Watch:
    """One watch stream, read by a thread of its own; iterate it with `async for`.

    Invariant: events come in etcd's revision order, each once, the events of one revision
    queued together (`pending()` counts the rest of a transaction); after a reconnect the
    stream restarts at the revision after the last delivered one. `connected` tells
    whether the stream is up now.
    """

    def __init__(self, etcd: Etcd, key: str, range_end: str | None, start_revision: int,
                 max_pending: int):
        self._etcd = etcd
        self._key = key
        self._range_end = range_end
        self._next_revision = start_revision
        self._max_pending = max_pending
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._response: requests.Response | None = None
        self._lost = False
        self.connected = False
        self._idle_reopen = False  # reopening after an idle timeout: not worth a log line
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {key}", daemon=True)
        self._thread.start()

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self

    async def __anext__(self) -> WatchEvent:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, WatchLost):
            self._queue.put_nowait(item)
            raise item
        return item

    def pending(self) -> int:
        """Events received and not yet iterated."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop the stream (from the loop's thread); iteration ends after what is queued."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._etcd._watches.discard(self)
        with self._lock:
            _shutdown(self._response)
        self._queue.put_nowait(_END)

    async def __aenter__(self) -> "Watch":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    # -- the stream thread -----------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.05
        failing = False
        while not self._closed.is_set():
            try:
                self._stream()
            except _Compacted as e:
                self._deliver(WatchLost(f"watch of {self._key}: {e}"))
                return
            except (requests.RequestException, ValueError, KeyError, TypeError, OSError) as e:
                if self._closed.is_set():
                    break
                if self.connected:  # a stream that was up (idle timeout, etcd gone): reopen
                    self._idle_reopen = "Read timed out" in str(e)  # every idle timeout
                    if not self._idle_reopen:
                        log.info("etcd_watch_interrupted", key=self._key, error=str(e)[:200])
                    backoff = 0.05
                else:
                    self._idle_reopen = False  # a reopen failed: its next start gets a line
                    if not failing:
                        log.warning("etcd_watch_failing", key=self._key, error=str(e)[:200],
                                    endpoint=self._etcd.endpoint)
                        failing = True
                if not self.connected and len(self._etcd._clients) > 1:
                    self._etcd._current = (self._etcd._current + 1) % len(self._etcd._clients)
            else:
                backoff = 0.05
            if self.connected and failing:
                failing = False
            self.connected = False
            if self._lost:
                return
            self._closed.wait(backoff)
            backoff = min(backoff * 2, 1.0)

    def _stream(self) -> None:
        client = self._etcd._clients[self._etcd._current]
        create: dict[str, Any] = {"key": _b64(self._key)}
        if self._range_end is not None:
            create["range_end"] = _b64(self._range_end)
        if self._next_revision:
            create["start_revision"] = self._next_revision
        with requests.Session() as session:
            response = session.post(client.get_url("/watch"), json={"create_request": create},
                                    stream=True,
                                    timeout=(self._etcd.timeout, self._etcd.watch_idle_timeout))
            with self._lock:
                if self._closed.is_set():
                    response.close()
                    return
                self._response = response
            try:
                response.raise_for_status()
                buffer = ""
                for chunk in response.iter_content(chunk_size=None):
                    buffer = self._on_data(buffer + chunk.decode("utf-8", "replace"))
                    if self._closed.is_set() or self._lost:
                        return
                    if len(buffer) > _MAX_MESSAGE:
                        raise ValueError(f"watch message over {_MAX_MESSAGE} bytes")
            finally:
                with self._lock:
                    self._response = None
                response.close()

    def _on_data(self, buffer: str) -> str:
        """Handle every whole JSON message at the start of `buffer`: the rest."""
        while True:
            buffer = buffer.lstrip()
            if not buffer:
                return buffer
            try:
                message, end = _JSON.raw_decode(buffer)
            except ValueError:
                return buffer  # not whole yet
            self._on_message(message)
            buffer = buffer[end:]

    def _on_message(self, message: dict) -> None:
        if "error" in message:
            raise ValueError(f"watch stream error: {message['error']}")
        result = message["result"]
        if result.get("compact_revision"):
            raise _Compacted(f"history before revision {result['compact_revision']} is compacted")
        if result.get("canceled"):
            raise ValueError(f"watch canceled: {result.get('cancel_reason', '')}")
        if result.get("created"):
            if not self._next_revision:
                self._next_revision = int(result["header"]["revision"]) + 1
            if not self._idle_reopen:
                log.info("etcd_watch_started", key=self._key, revision=self._next_revision)
            self._idle_reopen = False
            self.connected = True
            return
        events = []
        for event in result.get("events", []):
            kv = KeyValue.from_json(event["kv"])
            events.append(WatchEvent("delete" if event.get("type") == "DELETE" else "put", kv))
        if events:
            # one message holds whole revisions (a transaction's every key): queued together,
            # so a consumer that waits for `pending() == 0` never sees half a transaction
            self._deliver(events)
            self._next_revision = max(e.kv.mod_revision for e in events) + 1

    def _deliver(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._closed.set()

    def _put(self, item) -> None:
        if isinstance(item, list):  # the events of one message
            for event in item:
                self._put(event)
            return
        if self._lost or self._closed.is_set():
            return
        if isinstance(item, WatchLost) or self._queue.qsize() >= self._max_pending:
            self._lost = True
            if not isinstance(item, WatchLost):
                item = WatchLost(f"watch of {self._key}: consumer more than "
                                 f"{self._max_pending} events behind")
            with self._lock:
                _shutdown(self._response)
        self._queue.put_nowait(item)


def _shutdown(response: requests.Response | None) -> None:
    """Unblock a thread reading `response` (a shutdown of its socket wakes the read)."""
    if response is None:
        return
    try:
        fd = os.dup(response.raw.fileno())
    except (OSError, ValueError, AttributeError):
        return
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
