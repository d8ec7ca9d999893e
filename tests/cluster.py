"""A real cluster for tests: one etcd, nsqlookupds and nsqds in cluster mode, each its own
process on free loopback ports, each restartable and killable on its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request

from etcdserver import EtcdProcess
from isr.etcd import Etcd
from isr.metadata import Metadata
from isr.state import PartitionState
from nsqclient.conn import Connection
from nsqwire import commands as c
from servers import NsqdProcess, NsqlookupdProcess, free_port

LEASE_TTL_S = 2
START_WAIT_S = 30  # generous: three daemons and etcd start side by side with a suite's load


def http_json(method: str, url: str, timeout: float = 5) -> tuple[int, dict]:
    """(status, JSON body) of an HTTP call; an error status is returned, not raised."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, {"raw": body.decode(errors="replace")}


async def pub(address: str, topic: str, partition: int, body: bytes) -> bytes:
    """`PUB topic partition` on a fresh connection to `address`: the answer (NSQError raised)."""
    host, port = address.rsplit(":", 1)
    conn = await Connection(host, int(port)).connect()
    try:
        return await conn.command(c.cmd_pub(topic, body, partition=partition))
    finally:
        await conn.close()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """The first truthy value of predicate() within timeout, else AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(interval)


class Cluster:
    """etcd + `lookupds` nsqlookupds + `nsqds` nsqds, cluster id `test`, lease TTL 2 s.
    The lookupds run with `--leader-balance off` unless `leader_balance`: a test that
    places leaders itself (a move, a failover) finds them where it put them."""

    def __init__(self, root: str, nsqds: int = 3, lookupds: int = 2, *nsqd_flags: str,
                 leader_balance: bool = False):
        self.root = root
        self.etcd = EtcdProcess(os.path.join(root, "etcd"))
        common = ("--etcd-endpoints", self.etcd.endpoint, "--cluster-id", "test",
                  "--etcd-lease-ttl", f"{LEASE_TTL_S}s")
        balance = () if leader_balance else ("--leader-balance", "off")
        self.lookupds = [NsqlookupdProcess(os.path.join(root, "logs"), *common, *balance)
                         for _ in range(lookupds)]
        self.nsqds = []
        for i in range(nsqds):
            rpc = f"127.0.0.1:{free_port()}"
            self.nsqds.append(NsqdProcess(os.path.join(root, f"nsqd{i}"), *common,
                                          "--rpc-address", rpc, *nsqd_flags))

    def start(self) -> "Cluster":
        """Every process started and every nsqd registered; on any failure what was started
        is stopped before the error is raised (a fixture whose start failed never tears
        down: its daemons would run on through the rest of the suite)."""
        os.makedirs(self.root, exist_ok=True)
        expected = {n.tcp_address for n in self.nsqds}
        try:
            self.etcd.start()
            for p in self.lookupds + self.nsqds:
                p.start()
            wait_until(lambda: self.live_nodes() == expected, START_WAIT_S,
                       "every nsqd registered in etcd, as the lookupds see it")
        except AssertionError as e:
            report = self._start_report(expected)
            self.stop()
            raise AssertionError(f"{e}\n{report}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def _start_report(self, expected: set[str]) -> str:
        """What a failed start saw: the nodes the lookupds list, and the log of each process
        that is missing or gone (a parallel suite run on a loaded machine is the usual case)."""
        seen = self.live_nodes()
        lines = [f"lookupds list {sorted(seen)}, expected {sorted(expected)}"]
        for p in self.lookupds + self.nsqds:
            missing = p in self.nsqds and p.tcp_address not in seen
            alive = p.proc is not None and p.proc.poll() is None
            if missing or not alive:
                lines.append(f"--- {p.name} {p.tcp_address} alive={alive}:\n{p.log()[-2000:]}")
        lines.append(f"--- etcd healthy={self.etcd.healthy()}:\n{self.etcd.log()[-2000:]}")
        return "\n".join(lines)

    def stop(self) -> None:
        """Every process stopped (a SIGSTOPped nsqd continued first, so SIGTERM stops it)."""
        for n in self.nsqds:
            if n.proc is not None and n.proc.poll() is None:
                try:
                    os.kill(n.proc.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        for p in self.nsqds + self.lookupds:
            try:
                p.stop()
            except Exception:
                p.kill()
        self.etcd.kill()

    # ---- views through nsqlookupd ------------------------------------------------

    def lookupd_get(self, path: str, lookupd: int | None = None) -> tuple[int, dict]:
        """GET from one lookupd (the first that answers when `lookupd` is None)."""
        order = [lookupd] if lookupd is not None else range(len(self.lookupds))
        last = (0, {})
        for i in order:
            p = self.lookupds[i]
            if p.proc is None or p.proc.poll() is not None:
                continue
            try:
                return http_json("GET", f"http://{p.http_address}{path}")
            except OSError as e:
                last = (0, {"error": str(e)})
        return last

    def live_nodes(self) -> set[str]:
        status, body = self.lookupd_get("/nodes")
        if status != 200:
            return set()
        return {f"{p['broadcast_address']}:{p['tcp_port']}" for p in body.get("producers", [])}

    def master(self) -> int | None:
        """Index of the master nsqlookupd, from /listlookup."""
        status, body = self.lookupd_get("/listlookup")
        leader = (body or {}).get("lookupdleader") or {}
        for i, p in enumerate(self.lookupds):
            if str(leader.get("HttpPort")) == str(p.http_port):
                return i
        return None

    def create_topic(self, topic: str, partitions: int, replicas: int = 1,
                     **settings) -> tuple[int, dict]:
        """/topic/create on the master nsqlookupd; `settings` go as more query arguments."""
        extra = "".join(f"&{k}={v}" for k, v in settings.items())
        master = wait_until(lambda: self.master() is not None and self.master() + 1, 10,
                            "a master nsqlookupd") - 1
        return http_json("POST", f"http://{self.lookupds[master].http_address}/topic/create"
                                 f"?topic={topic}&partition_num={partitions}"
                                 f"&replicator={replicas}{extra}")

    def lookup(self, topic: str) -> dict:
        status, body = self.lookupd_get(f"/lookup?topic={topic}")
        return body if status == 200 else {}

    def leaders(self, topic: str) -> dict[int, str]:
        """partition -> leader's TCP address, as /lookup says."""
        return {int(n): f"{p['broadcast_address']}:{p['tcp_port']}"
                for n, p in self.lookup(topic).get("partitions", {}).items()}

    def nsqd_at(self, tcp_address: str) -> NsqdProcess:
        return next(n for n in self.nsqds if n.tcp_address == tcp_address)

    # ---- partition states, read from etcd ---------------------------------------------

    async def states(self, topic: str) -> dict[int, PartitionState]:
        """partition -> its state in etcd (leader, isr, catchup, epoch); {} without the topic."""
        etcd = Etcd(self.etcd.endpoint)
        try:
            view = await Metadata(etcd, "test").read()
        finally:
            await etcd.close()
        tv = view.topics.get(topic)
        return dict(tv.partitions) if tv is not None else {}

    async def until_states(self, topic: str, ok, timeout: float,
                           what: str) -> dict[int, PartitionState]:
        """The first states of `topic` for which `ok(states)` holds, within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            s = await self.states(topic)
            if s and ok(s):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout:g} s: {what}; states {s}")
            await asyncio.sleep(0.05)
