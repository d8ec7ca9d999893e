"""jepsen's loopback fallback partitions (jepsen/proxy.py), without root: a relay owned by
one host attributes each connection to the host whose process opened it, relays it,
stalls a cut pair both ways (old connections and new ones) while the harness's own
connections go on, and delivers every held byte in order after the heal; the broadcast
ports the loopback hosts advertise are what nsqd and nsqlookupd register in etcd. A short
loopback run with the partition nemesis is in test_jepsen.py, with every harness run."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from isr.etcd import Etcd
from isr.metadata import Metadata
from jepsen import ports
from jepsen.ports import free_port
from jepsen.proxy import Relays
from servers import NsqdProcess, NsqlookupdProcess

# a process of "host a": stdin to the socket, the socket to stdout
PIPE = """
import os, socket, sys, threading
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def up():
    while data := os.read(0, 65536):
        s.sendall(data)
threading.Thread(target=up, daemon=True).start()
while data := s.recv(65536):
    os.write(1, data)
"""


class Child:
    """A process that connects to `port` and pipes its stdin and stdout through it."""

    def __init__(self, port: int, owners: dict, host: str):
        self.proc = subprocess.Popen([sys.executable, "-c", PIPE, str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        owners[self.proc.pid] = host
        self.out = bytearray()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        while data := os.read(self.proc.stdout.fileno(), 65536):
            self.out += data

    def send(self, data: bytes) -> None:
        threading.Thread(target=lambda: (self.proc.stdin.write(data), self.proc.stdin.flush()),
                         daemon=True).start()

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def until(predicate, timeout: float = 10, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


def recv_exactly(sock: socket.socket, n: int, timeout: float = 10) -> bytes:
    sock.settimeout(timeout)
    out = bytearray()
    while len(out) < n:
        data = sock.recv(n - len(out))
        assert data, "closed"
        out += data
    return bytes(out)


def nothing_arrives(sock: socket.socket, wait: float = 1.0) -> bool:
    sock.settimeout(wait)
    try:
        sock.recv(1)
    except socket.timeout:
        return True
    return False


def test_each_xdist_worker_hands_out_ports_of_its_own_slice(monkeypatch):
    """Two workers never hand out one port (a node restarted on its port found it taken by
    another worker's daemon), and every port is below the kernel's ephemeral range."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    shares = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        low, high = ports._share()
        port = free_port()
        assert low <= port <= high < ports._ephemeral_low(), (worker, low, port, high)
        shares.append((low, high))
    (low0, high0), (low1, high1) = shares
    assert low0 == ports.LOWEST and high0 < low1
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert ports._share() == (ports.LOWEST, ports._ephemeral_low() - 1)  # not under xdist


def test_relay_attributes_cuts_both_ways_and_resumes_without_loss():
    owners: dict[int, str] = {}
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)
    port = free_port()
    relays = Relays(lambda: dict(owners))
    children, sockets = [], [srv]
    try:
        relays.add("b", port, srv.getsockname()[1])  # host b's port
        a = Child(port, owners, "a")  # a process of host a connects to it
        children.append(a)
        conn, _ = srv.accept()
        mine = socket.create_connection(("127.0.0.1", port))  # the harness's: no owner
        mine_far, _ = srv.accept()
        sockets += [conn, mine, mine_far]
        until(lambda: len(relays.connections()) == 2)
        assert relays.connections() == [("a", "b"), (None, "b")]

        a.send(b"hello")  # relayed both ways
        assert recv_exactly(conn, 5) == b"hello"
        conn.sendall(b"world")
        until(lambda: a.out == b"world", what="bytes back to a")

        relays.drop("b", ["a"])  # b drops what a sends: TCP between them stalls both ways
        up, down = os.urandom(300_000), os.urandom(300_000)
        a.send(up)
        threading.Thread(target=conn.sendall, args=(down,), daemon=True).start()
        assert nothing_arrives(conn)
        assert a.out == b"world"
        mine.sendall(b"ping")  # the harness is never cut
        assert recv_exactly(mine_far, 4) == b"ping"
        late = Child(port, owners, "a")  # a new connection: accepted, not connected on
        children.append(late)
        srv.settimeout(1)
        with pytest.raises(socket.timeout):
            srv.accept()
        until(lambda: relays.connections().count(("a", "b")) == 2, what="late attributed")

        assert relays.heal() == 2  # both of a's connections were held
        assert recv_exactly(conn, len(up)) == up  # every byte, in order
        until(lambda: len(a.out) == 5 + len(down), what="the held bytes to a")
        assert a.out == b"world" + down
        srv.settimeout(10)
        late_far, _ = srv.accept()
        sockets.append(late_far)
        late.send(b"late")
        assert recv_exactly(late_far, 4) == b"late"
    finally:
        for c in children:
            c.kill()
        relays.close()
        for sock in sockets:
            sock.close()


async def test_broadcast_ports_are_what_nsqd_and_nsqlookupd_register(tmp_path, etcd_server):
    """The loopback hosts listen on one port and advertise another (the relay's): nsqd's
    --broadcast-rpc-port and nsqlookupd's --broadcast-tcp-port/--broadcast-http-port are
    what etcd holds for them."""
    common = ("--etcd-endpoints", etcd_server.endpoint, "--cluster-id", "t",
              "--etcd-lease-ttl", "2s", "--broadcast-address", "127.0.0.1")
    rpc, tcp, http = free_port(), free_port(), free_port()
    nsqd = NsqdProcess(str(tmp_path / "n1"), *common, "--broadcast-rpc-port", str(rpc)).start()
    lookupd = NsqlookupdProcess(str(tmp_path), *common, "--broadcast-tcp-port", str(tcp),
                                "--broadcast-http-port", str(http)).start()
    etcd = Etcd(etcd_server.endpoint)
    try:
        meta = Metadata(etcd, "t")
        deadline = time.monotonic() + 15
        while True:
            view = await meta.read()
            if view.nodes and view.lookupds:
                break
            assert time.monotonic() < deadline, "nsqd and nsqlookupd registered"
            await asyncio.sleep(0.1)
        assert [n.rpc for n in view.nodes.values()] == [f"127.0.0.1:{rpc}"]
        assert [(x.tcp, x.http) for x in view.lookupds.values()] == [
            (f"127.0.0.1:{tcp}", f"127.0.0.1:{http}")]
        assert nsqd.rpc_address != f"127.0.0.1:{rpc}"  # it listens elsewhere
    finally:
        await etcd.close()
        nsqd.kill()
        lookupd.kill()
