"""A real etcd server (Debian etcd-server) on loopback for tests: free ports, its own data
dir, stopped with SIGKILL (a SIGTERM can hang without quorum), restartable on the same
ports and data dir."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request

from servers import free_port


class EtcdProcess:
    def __init__(self, data_dir: str, client_port: int = 0, peer_port: int = 0,
                 extra: tuple[str, ...] = ()):
        self.data_dir = data_dir
        self.extra = extra  # flags after the defaults (a repeated flag: the last wins)
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir + ".log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 15) -> "EtcdProcess":
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed: run scripts/setup.sh")
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [binary, "--name", "n1", "--data-dir", self.data_dir,
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"n1={peer}", "--max-txn-ops", "2048",
             "--heartbeat-interval", "50", "--election-timeout", "500",
             "--log-level", "warn", *self.extra],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log()}")
            if self.healthy():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not start: {self.log()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def kill(self) -> None:
        """SIGKILL and wait: a crash (and the only safe way to stop it quickly)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def post(self, path: str, body: dict) -> dict:
        """A raw call to the v3 gateway (for what the code under test must not do itself)."""
        req = urllib.request.Request(self.endpoint + "/v3/" + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

