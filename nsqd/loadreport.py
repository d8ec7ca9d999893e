"""Cluster mode: this node's load, written to etcd every INTERVAL_S (isr/load.py's report).

`load/<node-id>` is put under the node's registration lease, so it goes with the node;
nothing is written while the lease is lost. Rates are the growth of each partition's
committed log (bytes, messages) over the interval: writes for a led partition, replicated
writes for a followed one. A failed put is logged and tried at the next interval: a
report is never worth blocking anything for.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from isr import keys
from isr.etcd import EtcdError
from isr.load import NodeLoad, PartitionLoad

log = structlog.get_logger("nsqd.loadreport")

INTERVAL_S = 2.0


class LoadReporter:
    """Measures and writes this node's load (module docstring). `run()` is its task."""

    def __init__(self, cluster, interval: float = INTERVAL_S):
        self.cluster = cluster
        self.interval = interval
        self.last: NodeLoad | None = None
        self._ends: dict[str, tuple[int, int]] = {}  # "t/n" -> (committed bytes, count)
        self._at = (time.monotonic(), time.process_time())

    def measure(self) -> NodeLoad:
        """Partition loads since the last call, and the process's CPU over it."""
        now, cpu = time.monotonic(), time.process_time()
        elapsed = max(now - self._at[0], 1e-3)
        cpu_share = max(0.0, (cpu - self._at[1]) / elapsed)
        self._at = (now, cpu)
        ends, parts = {}, {}
        for name, topic in list(self.cluster.nsqd.topics.items()):
            for n, p in list(topic.writable.items()):
                parts[f"{name}/{n}"] = (p.queue, p.depth(), True)
        for (name, n), follower in list(self.cluster.replication.followers.items()):
            parts.setdefault(f"{name}/{n}", (follower.q, 0, False))
        loads = {}
        for key, (q, backlog, leader) in parts.items():
            end = (q.committed_end, q.committed_count)
            ends[key] = end
            before = self._ends.get(key, end)
            loads[key] = PartitionLoad(max(0, end[1] - before[1]) / elapsed,
                                       max(0, end[0] - before[0]) / elapsed,
                                       max(0, q.committed_end - q.start_offset),
                                       max(0, backlog), leader)
        self._ends = ends
        self.last = NodeLoad(self.cluster.node_id, int(time.time() * 1000), elapsed,
                             cpu_share, loads)
        return self.last

    async def run(self) -> None:
        key = keys.load(self.cluster.cluster_id, self.cluster.node_id)
        while True:
            await asyncio.sleep(self.interval)
            report = self.measure()
            lease = self.cluster.registration.lease_id
            if not lease:
                continue
            try:
                await self.cluster.etcd.put(key, report.encode(), lease=lease)
            except EtcdError as e:
                log.warning("load_report_failed", error=str(e))
