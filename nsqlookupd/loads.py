"""The nodes' load reports (`load/<node-id>`, isr/load.py) as this nsqlookupd last read
them, and `GET /cluster/stats` built from them and the cluster view.

Every lookupd reads the `load/` prefix every POLL_S (one range read; the mirror skips
these keys, which change every few seconds). A report that does not decode is listed in
`problems` and its node counts as reporting nothing; a report of a node that is not live
is ignored (its lease took the key, or is about to).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from isr import keys
from isr.background import stop_task
from isr.etcd import Etcd, EtcdError
from isr.load import NodeLoad, node_factors, partition_loads, topic_factors
from isr.metadata import ClusterView
from isr.state import BadValue

log = structlog.get_logger("nsqlookupd.loads")

POLL_S = 2.0


class LoadReports:
    """`reports` {node id: NodeLoad}, read every POLL_S; `read_at` (monotonic) of the last."""

    def __init__(self, etcd: Etcd, cluster: str, poll: float = POLL_S):
        self.etcd = etcd
        self.prefix = keys.load_prefix(cluster)
        self.poll = poll
        self.reports: dict[str, NodeLoad] = {}
        self.problems: list[str] = []
        self.read_at = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> "LoadReports":
        self._task = asyncio.create_task(self._run(), name="load reports")
        return self

    async def close(self) -> None:
        await stop_task(self._task)

    async def read(self) -> None:
        kvs, _ = await self.etcd.get_prefix(self.prefix)
        reports, problems = {}, []
        for kv in kvs:
            try:
                report = NodeLoad.decode(kv.value, kv.key)
            except BadValue as e:
                problems.append(str(e))
                continue
            if kv.key != self.prefix + report.node:
                problems.append(f"{kv.key}: node {report.node!r} does not match its key")
                continue
            reports[report.node] = report
        self.reports, self.problems = reports, problems
        self.read_at = time.monotonic()

    async def _run(self) -> None:
        while True:
            try:
                await self.read()
            except EtcdError as e:
                log.warning("load_reports_unreadable", error=str(e))
            await asyncio.sleep(self.poll)


def cluster_stats(view: ClusterView, reports: dict[str, NodeLoad], topn: int,
                  stable: bool, now_ms: int) -> dict:
    """Pure: the `/cluster/stats` body (PROTOCOL.md's shape, plus the measured figures
    behind each load factor)."""
    live = {n: r for n, r in reports.items() if n in view.nodes}
    part = partition_loads(view, live)
    factors = node_factors(view, live, part)
    nodes = []
    for node_id in sorted(view.nodes):
        info, f, report = view.nodes[node_id], factors[node_id], live.get(node_id)
        host, _, tcp_port = info.tcp.rpartition(":")
        nodes.append({
            "id": node_id, "hostname": info.hostname, "broadcast_address": host,
            "tcp_port": int(tcp_port), "http_port": int(info.http.rpartition(":")[2]),
            "leader_load_factor": f["leader_load_factor"],
            "node_load_factor": f["node_load_factor"],
            "partitions_led": f["partitions_led"],
            "partitions_followed": f["partitions_followed"],
            "cpu": round(report.cpu, 4) if report else None,
            **(report.totals() if report else {"msgs_per_s": None, "bytes_per_s": None,
                                               "data_bytes": None, "backlog": None}),
            "report_age_ms": max(0, now_ms - report.ts_ms) if report else None})
    topics = [{"topic": t, "load_factor": f} for t, f in topic_factors(view, part)[:topn]]
    return {"stable": stable, "node_stat_list": nodes, "topn_topics": topics}
