"""Real server processes for tests: start an nsqd (or an nsqlookupd) on free loopback ports, wait until it
answers, stop it (SIGTERM, or SIGKILL to simulate a crash)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from jepsen.ports import free_port  # noqa: F401  (tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def http(node, method: str, path: str, body: bytes | None = None) -> tuple[int, object]:
    """(status, body: JSON when it is, else text) of a call to `node`'s HTTP API; an error
    status is returned, not raised."""
    req = urllib.request.Request(f"http://{node.http_address}{path}", data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


class DaemonProcess:
    """One of our daemons in a subprocess on free loopback ports, restartable on the same
    ports. A subclass gives its `module`, `name` and `arguments()`."""

    module = name = ""
    up_when_unhealthy = False  # a /ping error answer means it is up (not yet serving)

    def __init__(self, log_path: str, extra, tcp_port: int, http_port: int):
        self.extra = list(extra)
        self.tcp_port = tcp_port or free_port()
        self.http_port = http_port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = log_path
        self.env: dict[str, str] = {}  # added to the environment of each start (faketime)

    @property
    def tcp_address(self) -> str:
        return f"127.0.0.1:{self.tcp_port}"

    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def arguments(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout: float = 15):
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.arguments(),
                 "--tcp-address", self.tcp_address, "--http-address", self.http_address,
                 "--broadcast-address", "127.0.0.1", *self.extra],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, **self.env} if self.env else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                                   f"{self.log()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_address}/ping", timeout=1):
                    return self
            except urllib.error.HTTPError:
                if self.up_when_unhealthy:
                    return self
                time.sleep(0.05)
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start: {self.log()}")

    def stop(self, timeout: float = 15) -> int:
        """SIGTERM and wait: the clean shutdown path. Returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""


class NsqdProcess(DaemonProcess):
    """`nsqd` with its own data path (its log is `nsqd.log` in it)."""

    module, name = "nsqd.main", "nsqd"
    up_when_unhealthy = True  # it answers, unhealthy (a partition did not open): it is up

    def __init__(self, data_path: str, *extra: str, tcp_port: int = 0, http_port: int = 0):
        super().__init__(os.path.join(data_path, "nsqd.log"), extra, tcp_port, http_port)
        self.data_path = data_path
        # cluster mode serves replication: a port of its own unless the test gives one
        self.rpc_address = next((extra[i + 1] for i, a in enumerate(extra[:-1])
                                 if a == "--rpc-address"), f"127.0.0.1:{free_port()}")

    def arguments(self) -> list[str]:
        args = ["--data-path", self.data_path]
        if "--etcd-endpoints" in self.extra and "--rpc-address" not in self.extra:
            args += ["--rpc-address", self.rpc_address]
        return args

    def trace_store_pids(self) -> list[int]:
        """The pids of its children that run its SQLite trace store (trace/process.py)."""
        pid = self.proc.pid
        children = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(x) for x in f.read().split()]
        found = []
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"nsqtrace.process" in f.read():
                    found.append(child)
        return found


class NsqlookupdProcess(DaemonProcess):
    """`nsqlookupd`, its log in `log_dir`."""

    module, name = "nsqlookupd.main", "nsqlookupd"

    def __init__(self, log_dir: str, *extra: str, tcp_port: int = 0, http_port: int = 0):
        super().__init__("", extra, tcp_port, http_port)
        self.log_path = os.path.join(log_dir, f"nsqlookupd-{self.tcp_port}.log")

    def arguments(self) -> list[str]:
        return []
