"""What the nsqadmin tests share: an nsqadmin process, a classic pair (nsqlookupd without
etcd + one nsqd registered with it), an HTTP client with cookies (CSRF, sessions), a
consumer running in a thread (the browser test is synchronous: Playwright's sync API), a
raw consumer that answers each message itself (FIN or REQ), and half messages published
over nsqd's HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.cookiejar import CookieJar

from cluster import wait_until
from nsqclient.conn import Connection
from nsqwire import commands, protocol
from servers import ROOT, NsqdProcess, NsqlookupdProcess, free_port

PASSWORD = "s3cret-pass"


class NsqadminProcess:
    """`python -m nsqadmin` on a free port, polling every 0.5 s."""

    def __init__(self, log_path: str, *args: str):
        self.port = free_port()
        self.args = ["--http-address", f"127.0.0.1:{self.port}", "--poll-interval", "500ms",
                     *args]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "NsqadminProcess":
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "nsqadmin", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

        def up():
            assert self.proc.poll() is None, open(self.log_path).read()
            try:
                with urllib.request.urlopen(self.url + "/ping", timeout=1):
                    return True
            except OSError:
                return False
        wait_until(up, 15, "nsqadmin answers /ping")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def password_file(root: str) -> str:
    path = os.path.join(root, "admins")
    with open(path, "w") as f:
        f.write(f"ops:{PASSWORD}\n")
    return path


class Classic:
    """A classic nsqlookupd and one nsqd registered with it (no etcd)."""

    def __init__(self, root: str):
        self.lookupd = NsqlookupdProcess(os.path.join(root, "logs"))
        self.nsqd = NsqdProcess(os.path.join(root, "single"), "--lookupd-tcp-address",
                                self.lookupd.tcp_address)

    def start(self) -> "Classic":
        self.lookupd.start()
        self.nsqd.start()
        return self

    def stop(self) -> None:
        for p in (self.nsqd, self.lookupd):
            try:
                p.stop()
            except Exception:
                p.kill()


class Client:
    """HTTP with a cookie jar: the CSRF cookie from GET /api/csrf, a session after login."""

    def __init__(self, base: str):
        self.base = base
        self.jar = CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        self.csrf = ""

    def request(self, method: str, path: str, body=None, csrf: bool = True,
                headers: dict | None = None) -> tuple[int, object, dict]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        if method == "POST" and data is None:
            data = b""
        h = {"Content-Type": "application/json"} if isinstance(body, dict) else {}
        if csrf and method == "POST":
            if not self.csrf:
                self.csrf = self.get("/api/csrf")[1]["csrf"]
            h["X-CSRF-Token"] = self.csrf
        h.update(headers or {})
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=h)
        try:
            with self.opener.open(req, timeout=20) as r:
                status, raw, hdrs = r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            status, raw, hdrs = e.code, e.read(), dict(e.headers)
        try:
            return status, json.loads(raw), hdrs
        except ValueError:
            return status, raw.decode("utf-8", "replace"), hdrs

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def post(self, path: str, body=None, **kw):
        return self.request("POST", path, body, **kw)


def post_nsqd(address: str, path: str, body: bytes = b"") -> int:
    req = urllib.request.Request(f"http://{address}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def publish(address: str, path: str, body: bytes, timeout: float = 15) -> int:
    """POST /pub, retried while the node answers 503 or 400 (a new partition's leader not
    yet writable, or not yet leading: nothing was written); the last status."""
    deadline = time.monotonic() + timeout
    while True:
        status = post_nsqd(address, path, body)
        if status not in (400, 503) or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


NO_CHECK_BACK = "http://127.0.0.1:9/never"  # nobody answers: only the decisions sent count


def publish_half(address: str, topic: str, partition: int, body: bytes,
                 timeout: float = 15) -> str:
    """POST /half (its check-back URL NO_CHECK_BACK), retried as `publish` is: the half
    message's id."""
    path = f"/half?topic={topic}&partition={partition}&check_url={NO_CHECK_BACK}"
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(f"http://{address}{path}", data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.loads(r.read())["id"]
        except urllib.error.HTTPError as e:
            if e.code not in (400, 503) or time.monotonic() > deadline:
                raise AssertionError(f"POST {path}: {e.code} {e.read()!r}") from None
        time.sleep(0.1)


class ThreadConsumer:
    """A real NSQ consumer (nsqclient.Connection, SUB with RDY 10) in its own thread and
    event loop; every message is FINed and put in `received` as (id, body)."""

    def __init__(self, tcp_address: str, topic: str, channel: str):
        self.host, port = tcp_address.rsplit(":", 1)
        self.port, self.topic, self.channel = int(port), topic, channel
        self.received: queue.Queue = queue.Queue()
        self.ready = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> "ThreadConsumer":
        self.thread.start()
        assert self.ready.wait(10), "consumer did not subscribe"
        return self

    async def _run(self) -> None:
        conn = await Connection(self.host, self.port).connect()
        await conn.sub(self.topic, self.channel, rdy=10)
        self.ready.set()
        try:
            while not self._stop.is_set():
                try:
                    m = await asyncio.wait_for(conn.messages.get(), 0.1)
                except asyncio.TimeoutError:
                    continue
                m.fin()
                self.received.put((m.id.decode(), m.body))
        finally:
            await conn.close()

    def take(self, timeout: float) -> tuple[str, bytes] | None:
        try:
            return self.received.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


class RawConsumer:
    """A raw consumer over a blocking socket (IDENTIFY, SUB, RDY 10) that answers each
    message itself: `take` a message, then `send` its FIN or REQ (nsqwire.commands)."""

    def __init__(self, tcp_address: str, topic: str, channel: str):
        host, port = tcp_address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.parser = commands.FrameParser()
        self.pending: list[tuple[int, bytes]] = []
        self.sock.sendall(protocol.MAGIC_V2 + commands.cmd_identify({})
                          + commands.cmd_sub(topic, channel) + commands.cmd_rdy(10))
        assert [self._frame(10), self._frame(10)] == [(protocol.FRAME_RESPONSE, b"OK")] * 2

    def _frame(self, timeout: float) -> tuple[int, bytes]:
        """The next frame but heartbeats (a heartbeat is answered with a NOP)."""
        deadline = time.monotonic() + timeout
        while True:
            while self.pending:
                frame = self.pending.pop(0)
                if frame != (protocol.FRAME_RESPONSE, b"_heartbeat_"):
                    return frame
                self.sock.sendall(commands.cmd_nop())
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = self.sock.recv(65536)
            assert data, "the node closed the connection"
            self.parser.feed(data)
            self.pending += list(self.parser.frames())

    def take(self, timeout: float = 10) -> tuple[int, bytes, bytes]:
        """(attempts, id, body) of the next message."""
        kind, data = self._frame(timeout)
        assert kind == protocol.FRAME_MESSAGE, (kind, data)
        return commands.parse_message(data)[1:]

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()


def until(predicate, timeout: float, what: str, interval: float = 0.1, detail=None):
    """The first truthy predicate(); else AssertionError naming `what` (and detail())."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}"
                                 + (f"; {detail()}" if detail else ""))
        time.sleep(interval)
