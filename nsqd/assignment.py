"""Assignment: which partitions of a topic this node serves.

Per topic: `partition_num` (how many partitions the topic has, cluster-wide), `leading`
(the partitions this node leads: it opens them, takes their publishes and serves their
channels), `ordered`, and `ext` (more topic meta a cluster driver may carry). Whether a
partition's log is replicated is the node's mode, not the topic's: every partition in
cluster mode (NSQD.queue_options). Single-node
mode: every topic is `Assignment.single()` unless made with `/topic/create?partition_num=N`
(N partitions, all led here). The cluster driver calls `NSQD.apply_assignment` with what
etcd says; the node stores it with the topic (metastore `topic/<name>` -> "assignment"),
so a restart serves the same partitions. A stored topic without one (written before
partitions were assignable) is `single()`.

Invariants: 1 <= partition_num <= MAX_PARTITIONS; leading is a subset of
range(partition_num). A pure value: NSQD does the I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_PARTITIONS = 1024


class AssignmentError(ValueError):
    """An assignment that breaks the invariants; the text says which."""


@dataclass(frozen=True)
class Assignment:
    partition_num: int
    leading: frozenset[int]
    ordered: bool = False
    ext: dict = field(default_factory=dict, compare=False)
    incarnation: int = 0

    def __post_init__(self) -> None:
        n = self.partition_num
        if not isinstance(n, int) or not 1 <= n <= MAX_PARTITIONS:
            raise AssignmentError(f"partition_num must be 1..{MAX_PARTITIONS}, not {n!r}")
        bad = sorted(p for p in self.leading if not isinstance(p, int) or not 0 <= p < n)
        if bad:
            raise AssignmentError(f"leading partitions {bad} are outside 0..{n - 1}")
        if not isinstance(self.incarnation, int) or self.incarnation < 0:
            raise AssignmentError(f"incarnation must be 0 or more, not {self.incarnation!r}")
        object.__setattr__(self, "leading", frozenset(self.leading))

    @classmethod
    def single(cls) -> "Assignment":
        """A topic of one partition, led here: every topic of a node without a cluster."""
        return cls(1, frozenset({0}))

    @classmethod
    def all_led(cls, partition_num: int) -> "Assignment":
        return cls(partition_num, frozenset(range(partition_num)))

    def in_range(self, partition: int) -> bool:
        return 0 <= partition < self.partition_num

    def with_(self, **changes) -> "Assignment":
        return dataclasses.replace(self, **changes)

    def state(self) -> dict:
        return {"partition_num": self.partition_num, "leading": sorted(self.leading),
                "ordered": self.ordered, "ext": dict(self.ext),
                "incarnation": self.incarnation}

    @classmethod
    def from_state(cls, state: dict | None) -> "Assignment":
        """From a stored topic state's "assignment"; `single()` when there is none."""
        if not state:
            return cls.single()
        return cls(state["partition_num"], frozenset(state["leading"]),
                   bool(state.get("ordered", False)), dict(state.get("ext", {})),
                   int(state.get("incarnation", 0)))
