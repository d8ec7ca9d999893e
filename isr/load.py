"""Node load reports (`load/<node-id>`, under the node's lease) and the load factors the
nsqlookupd master derives from them. Pure: no etcd, no clock.

A report is what one nsqd measured over its last interval: CPU of its process (fraction
of one core), and per partition it holds, messages and bytes written per second, data
size on disk and channel backlog (messages not yet read by the slowest channel; led
partitions only). It is decoded strictly (`BadValue`), so a stale or hand-written value
never crashes the master: the node then counts as reporting nothing.

Load factors (decided here; the issue only names them):
- a partition's load factor is `1 + msgs_per_s / 1000 + bytes_per_s / 1 MiB`: an idle
  led partition counts 1, a busy one more;
- a node's `leader_load_factor` is the sum over the partitions it leads (etcd says which,
  the report says how busy; a partition without a report counts 1);
- its `node_load_factor` is `leader_load_factor + FOLLOW_WEIGHT * partitions followed +
  CPU_WEIGHT * cpu` (a follower appends what the leader writes, at a fraction of the cost).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Mapping

from nsqwire.protocol import decode_json

from .keys import BadName, check_node_id
from .metadata import ClusterView
from .state import BadValue

MSGS_UNIT = 1000.0  # messages/s that add 1 to a partition's load factor
BYTES_UNIT = 1_048_576.0  # bytes/s that add 1
FOLLOW_WEIGHT = 0.25
CPU_WEIGHT = 4.0
MAX_PARTITIONS_REPORTED = 100_000

_PART_FIELDS = ("msgs_per_s", "bytes_per_s", "data_bytes", "backlog", "leader")


@dataclass(frozen=True)
class PartitionLoad:
    msgs_per_s: float = 0.0
    bytes_per_s: float = 0.0
    data_bytes: int = 0
    backlog: int = 0
    leader: bool = False

    @property
    def load_factor(self) -> float:
        return 1.0 + self.msgs_per_s / MSGS_UNIT + self.bytes_per_s / BYTES_UNIT


@dataclass(frozen=True)
class NodeLoad:
    """One node's report. `partitions` maps "topic/n" to its PartitionLoad."""

    node: str
    ts_ms: int
    interval_s: float
    cpu: float
    partitions: dict[str, PartitionLoad] = field(default_factory=dict)

    @property
    def led(self) -> int:
        return sum(1 for p in self.partitions.values() if p.leader)

    @property
    def followed(self) -> int:
        return sum(1 for p in self.partitions.values() if not p.leader)

    def totals(self) -> dict:
        ps = self.partitions.values()
        return {"msgs_per_s": round(sum(p.msgs_per_s for p in ps if p.leader), 2),
                "bytes_per_s": round(sum(p.bytes_per_s for p in ps if p.leader), 2),
                "data_bytes": sum(p.data_bytes for p in ps),
                "backlog": sum(p.backlog for p in ps)}

    def encode(self) -> bytes:
        body = {"node": self.node, "ts_ms": self.ts_ms, "interval_s": round(self.interval_s, 3),
                "cpu": round(self.cpu, 4), "partitions_led": self.led,
                "partitions_followed": self.followed, **self.totals(),
                "partitions": {k: [round(p.msgs_per_s, 2), round(p.bytes_per_s, 2),
                                   p.data_bytes, p.backlog, p.leader]
                               for k, p in sorted(self.partitions.items())}}
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str = "load") -> "NodeLoad":
        """Raises BadValue for anything but what `encode` writes."""
        try:
            obj = decode_json(raw)
        except ValueError as e:
            raise BadValue(key, f"not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise BadValue(key, "not a JSON object")
        try:
            node = check_node_id(obj["node"])
            ts_ms, interval_s, cpu = obj["ts_ms"], obj["interval_s"], obj["cpu"]
            parts = obj["partitions"]
            if type(ts_ms) is not int or not _number(interval_s) or not _number(cpu):
                raise BadValue(key, "bad ts_ms, interval_s or cpu")
            if not isinstance(parts, dict) or len(parts) > MAX_PARTITIONS_REPORTED:
                raise BadValue(key, "bad partitions")
            loads = {}
            for name, v in parts.items():
                if (not isinstance(name, str) or "/" not in name or not isinstance(v, list)
                        or len(v) != len(_PART_FIELDS) or not _number(v[0]) or not _number(v[1])
                        or type(v[2]) is not int or type(v[3]) is not int
                        or type(v[4]) is not bool):
                    raise BadValue(key, f"bad partition {str(name)[:80]!r}")
                loads[name] = PartitionLoad(float(v[0]), float(v[1]), v[2], v[3], v[4])
        except (KeyError, TypeError, BadName) as e:
            raise BadValue(key, f"bad report: {e}") from None
        return cls(node, ts_ms, float(interval_s), float(cpu), loads)


def _number(v) -> bool:
    return type(v) in (int, float) and v >= 0 and v == v and v != float("inf")


def partition_loads(view: ClusterView, loads: Mapping[str, NodeLoad]) -> dict[tuple[str, int], float]:
    """Per partition of the view, its load factor as its current leader reports it (1
    when the leader has not reported it yet)."""
    out = {}
    for t in view.topics.values():
        for n, s in t.partitions.items():
            report = loads.get(s.leader) if s.leader else None
            p = report.partitions.get(f"{t.name}/{n}") if report is not None else None
            out[(t.name, n)] = p.load_factor if p is not None else 1.0
    return out


def node_factors(view: ClusterView, loads: Mapping[str, NodeLoad],
                 part: Mapping[tuple[str, int], float] | None = None) -> dict[str, dict]:
    """Per live node: leader_load_factor, node_load_factor, partitions led and followed
    (from etcd's states), as the module docstring defines them."""
    part = partition_loads(view, loads) if part is None else part
    out = {n: {"leader_load_factor": 0.0, "partitions_led": 0, "partitions_followed": 0}
           for n in view.nodes}
    for t in view.topics.values():
        for n, s in t.partitions.items():
            if s.leader in out:
                out[s.leader]["leader_load_factor"] += part[(t.name, n)]
                out[s.leader]["partitions_led"] += 1
            for member in (*s.isr, *s.catchup):
                if member != s.leader and member in out:
                    out[member]["partitions_followed"] += 1
    for node, f in out.items():
        report = loads.get(node)
        cpu = report.cpu if report is not None else 0.0
        f["leader_load_factor"] = round(f["leader_load_factor"], 3)
        f["node_load_factor"] = round(f["leader_load_factor"]
                                      + FOLLOW_WEIGHT * f["partitions_followed"]
                                      + CPU_WEIGHT * cpu, 3)
    return out


def topic_factors(view: ClusterView,
                  part: Mapping[tuple[str, int], float]) -> list[tuple[str, float]]:
    """(topic, sum of its partitions' load factors), heaviest first (ties by name)."""
    sums: dict[str, float] = {}
    for (topic, _), f in part.items():
        sums[topic] = sums.get(topic, 0.0) + f
    return sorted(((t, round(f, 3)) for t, f in sums.items()), key=lambda x: (-x[1], x[0]))
