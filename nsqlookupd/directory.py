"""The directory of cluster mode: what the HTTP API reads, made from one ClusterView.

Pure: no I/O, no clock. A `ClusterDirectory` is immutable and belongs to one view; the
driver (cluster.py) makes a new one at each change of the mirror, so a request sees one
consistent view from start to end. `/lookup` answers are encoded once per (view, topic,
access) and served as bytes after that: the hot path of a lookupd is a dict hit.

Invariants:
- a producer is a live node (registered in etcd under its lease);
- a partition is in `partitions`, and its leader among the producers, only when its
  leader is a live node; any other partition is leaderless (listed by `leaderless()`);
- `producers` are the distinct live leaders of the topic's partitions, in node-id order.
"""

from __future__ import annotations

from isr.metadata import ClusterView, TopicView
from isr.state import NodeInfo
from nsqwire.httpapi import go_json


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def producer(node: NodeInfo) -> dict:
    """A node as classic /lookup shows a producer."""
    host, tcp_port = _host_port(node.tcp)
    return {"remote_address": node.tcp, "hostname": node.hostname,
            "broadcast_address": host, "tcp_port": tcp_port,
            "http_port": _host_port(node.http)[1], "version": node.version}


class ClusterDirectory:
    """Reads of the cluster's topics, channels and nodes, from `view` (None: not read yet)."""

    def __init__(self, view: ClusterView | None):
        self.view = view
        self._encoded: dict[tuple[str, str], bytes] = {}

    @property
    def ready(self) -> bool:
        return self.view is not None

    def _topics(self) -> dict[str, TopicView]:
        return self.view.topics if self.view is not None else {}

    # ---- the classic directory's reads (nsqlookupd/http.py calls these) -------------

    def has_topic(self, topic: str) -> bool:
        return topic in self._topics()

    def topics(self) -> list[str]:
        return sorted(self._topics())

    def channels(self, topic: str) -> list[str]:
        t = self._topics().get(topic)
        return sorted(t.channels) if t is not None else []

    def producers(self, topic: str, now: float = 0.0) -> list[dict]:
        return self.lookup(topic)["producers"]

    def nodes(self, now: float = 0.0) -> list[dict]:
        """Every live node, with the topics it leads a partition of and those partitions."""
        if self.view is None:
            return []
        led: dict[str, list[tuple[str, int]]] = {n: [] for n in self.view.nodes}
        for t in self.view.topics.values():
            for n, state in sorted(t.partitions.items()):
                if state.leader in led:
                    led[state.leader].append((t.name, n))
        out = []
        for node_id in sorted(self.view.nodes):
            topics = sorted({t for t, _ in led[node_id]})
            out.append({**producer(self.view.nodes[node_id]), "tombstones": [False] * len(topics),
                        "topics": topics,
                        "partitions": [{"topic": t, "partition": n} for t, n in led[node_id]]})
        return out

    # ---- cluster reads ----------------------------------------------------------------

    def lookup(self, topic: str, access: str = "r") -> dict:
        """The /lookup answer of a known topic (KeyError if unknown).

        `access` is accepted for the partition-aware clients: every live leader is
        writable today (replication, #7, will add leaders that only serve reads), so
        "r" and "w" give the same answer."""
        t = self._topics()[topic]
        nodes = self.view.nodes
        partitions = {str(n): producer(nodes[s.leader])
                      for n, s in sorted(t.partitions.items()) if s.leader in nodes}
        leaders = sorted({s.leader for s in t.partitions.values() if s.leader in nodes})
        return {"channels": sorted(t.channels),
                "producers": [producer(nodes[n]) for n in leaders],
                "partitions": partitions,
                "meta": {"partition_num": t.meta.partitions, "replica": t.meta.replicas,
                         "ordered": t.meta.ordered, "extend_support": t.meta.ext}}

    def lookup_bytes(self, topic: str, access: str = "r") -> bytes:
        """`lookup` encoded as Go's JSON, once per (topic, access) for this view."""
        key = (topic, access)
        body = self._encoded.get(key)
        if body is None:
            body = self._encoded[key] = go_json(self.lookup(topic, access))
        return body

    def leaderless(self) -> list[str]:
        """`topic:partition` of every partition without a live leader."""
        return [f"{t}:{n}" for t, n in self.view.leaderless()] if self.view else []

    def problems(self) -> list[str]:
        return list(self.view.problems) if self.view else []
