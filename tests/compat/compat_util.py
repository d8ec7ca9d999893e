"""Shared helpers for the client-compatibility suite (tests/compat).

Each real client library runs one *scenario* against our real nsqd process and
returns a JSON-able result; the tests assert on those results. The same
scenario names and result shapes are used by every driver:

- in-process: pynsq (tornado on the test's asyncio loop), ansq (asyncio);
- subprocess: gnsq (gevent monkey-patches the interpreter, so it runs in its
  own python: gnsq_scenarios.py) and nsqjs (node: js/scenarios.js).

Subprocess drivers read their parameters as JSON on stdin and print one JSON
object per line on stdout: progress events
(`{"event": ...}`) and finally `{"result": {...}}`.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import socket
import struct
import sys
import time
import uuid

COMPAT_DIR = os.path.dirname(os.path.abspath(__file__))
JS_DIR = os.path.join(COMPAT_DIR, "js")
PYTHON = sys.executable


def unique(prefix: str) -> str:
    """A topic/channel name no other test uses (valid NSQ name, < 64 chars)."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


# ---- subprocess scenarios ------------------------------------------------------


class ScenarioError(AssertionError):
    pass


async def run_process(argv: list[str], params: dict, timeout: float, on_event=None,
                      cwd: str | None = None) -> dict:
    """Run a scenario script with `params` as JSON on its stdin; return its result.

    `on_event(event_dict)` (may be a coroutine function) is called for every
    progress line. A hang fails the test after `timeout` seconds (the process is
    killed and its stderr shown)."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=cwd or COMPAT_DIR, limit=64 * 1024 * 1024)
    proc.stdin.write(json.dumps(params).encode())  # on stdin: bodies can exceed argv limits
    proc.stdin.close()
    stderr_chunks: list[bytes] = []

    async def drain_stderr():
        while True:
            chunk = await proc.stderr.read(65536)
            if not chunk:
                return
            stderr_chunks.append(chunk)

    async def read_stdout():
        result = None
        lines = []
        while True:
            line = await proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if "result" in obj:
                result = obj["result"]
            elif on_event is not None:
                r = on_event(obj)
                if asyncio.iscoroutine(r):
                    await r
        await proc.wait()
        return result, lines

    err_task = asyncio.ensure_future(drain_stderr())
    try:
        result, lines = await asyncio.wait_for(read_stdout(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        await err_task
        raise ScenarioError(f"{argv[-1]} {params.get('scenario')} timed out after {timeout}s; "
                            f"stderr:\n{b''.join(stderr_chunks).decode(errors='replace')[-3000:]}")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    await err_task
    if result is None:
        raise ScenarioError(
            f"{params.get('scenario')} gave no result (exit {proc.returncode}); stdout tail:\n"
            f"{b''.join(lines[-20:]).decode(errors='replace')}\nstderr:\n"
            f"{b''.join(stderr_chunks).decode(errors='replace')[-3000:]}")
    if isinstance(result, dict) and result.get("error"):
        raise ScenarioError(f"{params.get('scenario')} failed in the client: {result['error']}")
    return result


# ---- TLS -----------------------------------------------------------------------


def make_self_signed_cert(directory: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1/localhost, generated now; (cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    os.makedirs(directory, exist_ok=True)
    cert_path = os.path.join(directory, "server.pem")
    key_path = os.path.join(directory, "server.key")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.TraditionalOpenSSL,
                                  serialization.NoEncryption()))
    return cert_path, key_path


# ---- AUTH ----------------------------------------------------------------------

GOOD_SECRET = "s3cret-good"
PUB_ONLY_SECRET = "s3cret-pubonly"


class AuthServer:
    """A tiny auth server answering GET /auth like the classic nsq auth protocol.

    GOOD_SECRET: publish+subscribe on every topic/channel; PUB_ONLY_SECRET:
    publish only; anything else: 403. Every request's query is recorded."""

    def __init__(self):
        self.requests: list[dict] = []
        self.port = 0
        self._runner = None

    async def __aenter__(self) -> "AuthServer":
        from aiohttp import web

        async def auth(request):
            q = dict(request.query)
            self.requests.append(q)
            secret = q.get("secret")
            if secret == GOOD_SECRET:
                perms = ["subscribe", "publish"]
            elif secret == PUB_ONLY_SECRET:
                perms = ["publish"]
            else:
                return web.json_response({"message": "NOT_AUTHORIZED"}, status=403)
            return web.json_response({
                "ttl": 3600, "identity": f"user-{secret[-4:]}",
                "identity_url": "http://example.invalid/u",
                "authorizations": [{"topic": ".*", "channels": [".*"], "permissions": perms}]})

        app = web.Application()
        app.router.add_get("/auth", auth)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()


# ---- raw protocol (for what no client library exposes) ----------------------------


class RawConn:
    """A blocking raw V2 connection, for behaviour a library hides (heartbeat misses)."""

    def __init__(self, address: str, timeout: float = 5):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.sendall(b"  V2")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def command(self, line: str, body: bytes | None = None) -> None:
        data = line.encode() + b"\n"
        if body is not None:
            data += struct.pack(">I", len(body)) + body
        self.send(data)

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("connection closed")
            buf += chunk
        return buf

    def frame(self) -> tuple[int, bytes]:
        size, kind = struct.unpack(">II", self._exact(8))
        return kind, self._exact(size - 4)

    def close(self) -> None:
        self.sock.close()


def wait_closed(conn: RawConn, limit: float) -> tuple[float, list[bytes]]:
    """Read frames until the server closes; return (seconds until EOF, frames' data)."""
    start = time.monotonic()
    frames = []
    conn.sock.settimeout(limit)
    try:
        while True:
            kind, data = conn.frame()
            frames.append(data)
    except (EOFError, ConnectionResetError):
        return time.monotonic() - start, frames
