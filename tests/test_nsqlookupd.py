"""Our nsqlookupd as a real process: the classic HTTP API (envelopes, status codes,
errors), registrations made over real V1 TCP connections, tombstones and inactive
producers with short lifetimes, bad input on both ports, and the CLI."""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from nsqwire import lookupd as v1
from servers import ROOT, NsqlookupdProcess, free_port

INFO = {"broadcast_address": "node1", "tcp_port": 4150, "http_port": 4151,
        "version": "1.3.0", "hostname": "box1"}


def http(lookupd, method: str, path: str, body: bytes | None = None):
    """(status, headers, decoded body) of one request."""
    req = urllib.request.Request(f"http://{lookupd.http_address}{path}", method=method,
                                 data=body)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            status, headers, data = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, headers, data = e.code, e.headers, e.read()
    if headers.get("Content-Type", "").startswith("application/json"):
        data = json.loads(data)
    return status, headers, data


def get(lookupd, path):
    status, _, data = http(lookupd, "GET", path)
    return status, data


def post(lookupd, path):
    status, _, data = http(lookupd, "POST", path)
    return status, data


class Peer:
    """A raw V1 connection, as an nsqd makes it."""

    def __init__(self, lookupd, magic: bytes = v1.MAGIC_V1):
        self.sock = socket.create_connection(("127.0.0.1", lookupd.tcp_port), timeout=5)
        self.reader = v1.ResponseReader()
        self.sock.sendall(magic)

    def call(self, data: bytes) -> bytes:
        self.sock.sendall(data)
        return self.answer()

    def answer(self) -> bytes:
        while (r := self.reader.next_response()) is None:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.reader.feed(chunk)
        return r

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def lookupd(module_dir):
    p = NsqlookupdProcess(str(module_dir),
                          "--tombstone-lifetime", "1s", "--inactive-producer-timeout", "2s").start()
    yield p
    assert p.stop() == 0
    assert "Traceback" not in p.log()


def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ping_info_and_v1_envelope(lookupd):
    status, headers, body = http(lookupd, "GET", "/ping")
    assert (status, body) == (200, b"OK")
    assert headers["Content-Type"] == "text/plain; charset=utf-8"
    status, headers, body = http(lookupd, "GET", "/info")
    assert (status, body) == (200, {"version": "1.3.0"})
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    assert headers["X-NSQ-Content-Type"] == "nsq; version=1.0"


@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/lookup", 400, "MISSING_ARG_TOPIC"),
    ("GET", "/lookup?topic=never_made", 404, "TOPIC_NOT_FOUND"),
    ("GET", "/lookup?topic=%zz", 400, "INVALID_REQUEST"),
    ("GET", "/channels", 400, "MISSING_ARG_TOPIC"),
    ("POST", "/topic/create", 400, "MISSING_ARG_TOPIC"),
    ("POST", "/topic/create?topic=bad!name", 400, "INVALID_ARG_TOPIC"),
    ("POST", "/topic/delete", 400, "MISSING_ARG_TOPIC"),
    ("POST", "/channel/create?topic=t", 400, "MISSING_ARG_CHANNEL"),
    ("POST", "/channel/create?channel=c", 400, "MISSING_ARG_TOPIC"),
    ("POST", "/channel/create?topic=t&channel=" + "c" * 65, 400, "INVALID_ARG_CHANNEL"),
    ("POST", "/channel/create?topic=b@d&channel=c", 400, "INVALID_ARG_TOPIC"),
    ("POST", "/channel/delete?topic=t&channel=none", 404, "CHANNEL_NOT_FOUND"),
    ("POST", "/topic/tombstone?node=a:1", 400, "MISSING_ARG_TOPIC"),
    ("POST", "/topic/tombstone?topic=t", 400, "MISSING_ARG_NODE"),
    ("GET", "/topic/create?topic=t", 405, "METHOD_NOT_ALLOWED"),
    ("POST", "/lookup?topic=t", 405, "METHOD_NOT_ALLOWED"),
    ("GET", "/nope", 404, "NOT_FOUND"),
])
def test_http_errors_are_classic(lookupd, method, path, status, message):
    got, headers, body = http(lookupd, method, path)
    assert (got, body) == (status, {"message": message})
    if status == 405:
        assert "OPTIONS" in headers["Allow"]


def test_http_topic_and_channel_actions(lookupd):
    assert post(lookupd, "/topic/create?topic=made") == (200, b"")
    assert get(lookupd, "/lookup?topic=made") == (200, {"channels": [], "producers": []})
    assert post(lookupd, "/channel/create?topic=made2&channel=ch") == (200, b"")
    assert "made" in get(lookupd, "/topics")[1]["topics"]
    assert get(lookupd, "/channels?topic=made2") == (200, {"channels": ["ch"]})
    assert get(lookupd, "/channels?topic=unknown") == (200, {"channels": []})
    assert post(lookupd, "/channel/delete?topic=made2&channel=ch") == (200, b"")
    assert get(lookupd, "/channels?topic=made2") == (200, {"channels": []})
    assert post(lookupd, "/topic/delete?topic=made2") == (200, b"")
    assert post(lookupd, "/topic/delete?topic=never") == (200, b"")  # no error, as classic
    assert "made2" not in get(lookupd, "/topics")[1]["topics"]


def test_tcp_registrations_show_in_lookup_and_nodes(lookupd):
    peer = Peer(lookupd)
    answer = json.loads(peer.call(v1.cmd_identify(INFO)))
    assert answer["tcp_port"] == lookupd.tcp_port and answer["http_port"] == lookupd.http_port
    assert answer["version"] == "1.3.0" and answer["broadcast_address"] == "127.0.0.1"
    assert peer.call(v1.cmd_register("reg_t", "c1")) == b"OK"
    assert peer.call(v1.cmd_register("reg_t", "c2")) == b"OK"
    assert peer.call(v1.cmd_register("reg_u")) == b"OK"
    status, doc = get(lookupd, "/lookup?topic=reg_t")
    assert status == 200 and doc["channels"] == ["c1", "c2"]
    [producer] = doc["producers"]
    local = "%s:%d" % peer.sock.getsockname()
    assert producer == {**{k: INFO[k] for k in ("hostname", "broadcast_address", "tcp_port",
                                                "http_port", "version")},
                        "remote_address": local}
    node = next(n for n in get(lookupd, "/nodes")[1]["producers"] if n["remote_address"] == local)
    assert node["topics"] == ["reg_t", "reg_u"] and node["tombstones"] == [False, False]
    assert peer.call(v1.cmd_unregister("reg_t", "c2")) == b"OK"
    assert get(lookupd, "/lookup?topic=reg_t")[1]["channels"] == ["c1", "c2"]  # kept, no producer
    assert peer.call(v1.cmd_unregister("reg_u")) == b"OK"
    assert get(lookupd, "/lookup?topic=reg_u")[1]["producers"] == []
    peer.close()  # the connection closes: nothing of it is produced any more
    until(lambda: get(lookupd, "/lookup?topic=reg_t")[1]["producers"] == [])
    assert all(n["remote_address"] != local for n in get(lookupd, "/nodes")[1]["producers"])


def test_tombstone_hides_the_node_for_its_lifetime(lookupd):
    a, b = Peer(lookupd), Peer(lookupd)
    a.call(v1.cmd_identify(INFO))
    b.call(v1.cmd_identify({**INFO, "broadcast_address": "node2"}))
    for p in (a, b):
        p.call(v1.cmd_register("tomb_t"))
    assert post(lookupd, "/topic/tombstone?topic=tomb_t&node=node1:4151") == (200, b"")
    producers = get(lookupd, "/lookup?topic=tomb_t")[1]["producers"]
    assert [p["broadcast_address"] for p in producers] == ["node2"]
    nodes = {n["broadcast_address"]: n for n in get(lookupd, "/nodes")[1]["producers"]
             if "tomb_t" in n["topics"]}
    assert nodes["node1"]["tombstones"] == [True] and nodes["node2"]["tombstones"] == [False]
    for p in (a, b):  # keep them active past the 1 s lifetime
        p.call(v1.PING)
    time.sleep(1.1)
    a.call(v1.PING)
    assert len(get(lookupd, "/lookup?topic=tomb_t")[1]["producers"]) == 2
    a.close(), b.close()


def test_a_producer_that_stops_pinging_is_hidden(lookupd):
    quiet, alive = Peer(lookupd), Peer(lookupd)
    quiet.call(v1.cmd_identify({**INFO, "broadcast_address": "quiet"}))
    alive.call(v1.cmd_identify({**INFO, "broadcast_address": "alive"}))
    quiet.call(v1.cmd_register("idle_t"))
    alive.call(v1.cmd_register("idle_t"))
    deadline = time.monotonic() + 2.6
    while time.monotonic() < deadline:  # only `alive` pings; the timeout is 2 s
        alive.call(v1.PING)
        time.sleep(0.2)
    producers = get(lookupd, "/lookup?topic=idle_t")[1]["producers"]
    assert [p["broadcast_address"] for p in producers] == ["alive"]
    assert "quiet" not in [n["broadcast_address"] for n in get(lookupd, "/nodes")[1]["producers"]]
    quiet.call(v1.PING)  # it comes back with its next ping
    assert len(get(lookupd, "/lookup?topic=idle_t")[1]["producers"]) == 2
    quiet.close(), alive.close()


@pytest.mark.parametrize("magic, send, answer", [
    (b"  V2", b"", b"E_BAD_PROTOCOL"),
    (v1.MAGIC_V1, b"REGISTER t\n", b"E_INVALID client must IDENTIFY"),
    (v1.MAGIC_V1, b"IDENTIFY\n" + struct.pack(">i", -1), b"E_BAD_BODY IDENTIFY invalid body size -1"),
    (v1.MAGIC_V1, b"IDENTIFY\n" + struct.pack(">i", 4) + b"{{{{",
     b"E_BAD_BODY IDENTIFY failed to decode JSON body"),
    (v1.MAGIC_V1, v1.cmd_identify(INFO) + b"REGISTER b@d\n",
     b"E_BAD_TOPIC REGISTER topic name 'b@d' is not valid"),
    (v1.MAGIC_V1, b"x" * 5000, b"E_INVALID command line longer than 1024 bytes"),
    (v1.MAGIC_V1, b"\xff\xfe\x00\n", b"E_INVALID invalid command \xff\xfe\x00"),
])
def test_bad_tcp_input_gets_an_error_then_close(lookupd, magic, send, answer):
    peer = Peer(lookupd, magic)
    peer.sock.sendall(send)
    got = peer.answer()
    if got.startswith(b"{"):
        got = peer.answer()  # the answer to a good IDENTIFY came first
    assert got == answer
    assert peer.closed()
    peer.close()
    assert get(lookupd, "/ping") == (200, b"OK")


def test_garbage_never_kills_the_server(lookupd):
    import random

    rnd = random.Random(7)
    for i in range(60):
        s = socket.create_connection(("127.0.0.1", lookupd.tcp_port), timeout=5)
        s.sendall((v1.MAGIC_V1 if i % 2 else b"") + rnd.randbytes(rnd.randrange(1, 400)))
        s.close()
    with socket.create_connection(("127.0.0.1", lookupd.http_port), timeout=5) as s:
        s.sendall(b"GARBAGE \x00\xff\r\n\r\n")
        # aiohttp answers a request line it cannot parse as HTTP/1.0; the status counts
        assert s.recv(100).split(b"\r\n")[0] in (b"HTTP/1.0 400 Bad Request",
                                                   b"HTTP/1.1 400 Bad Request")
    assert get(lookupd, "/ping") == (200, b"OK")


def test_a_half_closed_client_gets_its_answer(lookupd):
    """`printf 'GET /ping ...' | nc`: the client's half-close ends what it sends, not
    what it reads (as with Go's net/http); with no request sent, the connection closes."""

    def exchange(data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", lookupd.http_port), timeout=5) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            return out

    out = exchange(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b"\r\n\r\nOK")
    out = exchange(b"GET /lookup?topic=nope HTTP/1.0\r\n\r\n")
    assert out.startswith(b"HTTP/1.0 404") and out.endswith(b'{"message":"TOPIC_NOT_FOUND"}')
    assert exchange(b"") == b""
    assert exchange(b"GET /ping HTTP/1.1\r\n") == b""  # half a request: nothing to answer


async def _identify_within(lookupd, monkeypatch) -> None:
    """TCP: a connection that has not identified within IDENTIFY_S gets E_INVALID and is
    closed (before, one that sent nothing stayed as long as it was connected); one that
    identified may then be quiet."""
    import asyncio

    from nsqlookupd import tcp

    monkeypatch.setattr(tcp, "IDENTIFY_S", 0.3)
    silent = await asyncio.open_connection("127.0.0.1", lookupd.tcp_port)
    known = await asyncio.open_connection("127.0.0.1", lookupd.tcp_port)
    silent[1].write(v1.MAGIC_V1)
    known[1].write(v1.MAGIC_V1 + v1.cmd_identify(INFO))
    async with asyncio.timeout(5):
        got = await silent[0].read()
    assert got == v1.error_response(v1.ProtocolError("E_INVALID", "IDENTIFY must come within 0.3 s"))
    await asyncio.sleep(0.3)
    known[1].write(v1.PING)
    async with asyncio.timeout(5):
        size = struct.unpack(">i", await known[0].readexactly(4))[0]
        assert json.loads(await known[0].readexactly(size))["tcp_port"] == lookupd.tcp_port
        size = struct.unpack(">i", await known[0].readexactly(4))[0]
        assert await known[0].readexactly(size) == v1.OK
    for _, writer in (silent, known):
        writer.close()


async def test_every_request_has_an_end(monkeypatch):
    """Half a request line is closed once IDLE_S passes (aiohttp's default keepalive, an
    hour, let it hold a descriptor that long), and a body that stops coming is 408
    BODY_TIMEOUT once BODY_S passes (before, it waited for as long as the client stayed
    connected). The body is read as for /channel/setoffset (cluster mode), through a
    route of the same kind added for the test."""
    import asyncio

    from nsqwire import httpapi
    from nsqlookupd.nsqlookupd import NSQLookupd
    from nsqlookupd.options import from_args

    monkeypatch.setattr(httpapi, "IDLE_S", 0.5)
    monkeypatch.setattr(httpapi, "BODY_S", 0.5)

    def echo(lookupd, params, body):
        return {"body": body.decode()}

    echo.takes_body = 100
    lookupd = NSQLookupd(from_args(["--tcp-address", "127.0.0.1:0",
                                    "--http-address", "127.0.0.1:0"], "test"))
    await lookupd.start()
    lookupd.routes["/echo"] = {"POST": echo}
    try:
        await _identify_within(lookupd, monkeypatch)
        reader, writer = await asyncio.open_connection("127.0.0.1", lookupd.http_port)
        writer.write(b"GET /pi")
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", lookupd.http_port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: l\r\nContent-Length: 100\r\n\r\n")
        got = b""
        async with asyncio.timeout(5):
            while not got.endswith(b"}"):
                got += await reader.read(65536)
        writer.write(b"x" * 100)  # the rest, late: read and dropped (aiohttp lingers 10 s)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # then closed, idle
        writer.close()
        assert got.startswith(b"HTTP/1.1 408 ") and got.endswith(b'{"message":"BODY_TIMEOUT"}')
    finally:
        await lookupd.stop()


# ---- CLI ----------------------------------------------------------------------------


def run_cli(*args, timeout=15):
    return subprocess.run([sys.executable, "-m", "nsqlookupd.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_version_and_help():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("nsqlookupd v1.3.0 (durable-nsq ")
    r = run_cli("-help")
    assert r.returncode == 0 and "--inactive-producer-timeout" in r.stdout
    assert "(default 5m0s)" in r.stdout and "(default 45s)" in r.stdout
    r = run_cli("--tombstone-lifetime", "forever")
    assert r.returncode == 2 and "invalid duration" in r.stderr


def test_port_in_use_is_one_line_and_exit_1():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli(f"-tcp-address=127.0.0.1:{port}", f"-http-address=127.0.0.1:{free_port()}")
        assert r.returncode == 1
        assert r.stderr.strip().splitlines()[-1] == (
            f"nsqlookupd: cannot listen on 127.0.0.1:{port} (--tcp-address): address already in use")
        r = run_cli("-tcp-address", f"127.0.0.1:{free_port()}", "-http-address",
                    f"127.0.0.1:{port}")
        assert r.returncode == 1 and "(--http-address)" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(tmp_path, sig):
    p = NsqlookupdProcess(str(tmp_path)).start()
    peer = Peer(p)
    peer.call(v1.cmd_identify(INFO))
    p.proc.send_signal(sig)
    assert p.proc.wait(10) == 0
    assert "Traceback" not in p.log()
    peer.close()
