"""The cluster's metadata in etcd: topics, channels, partition states, and the view of it all.

`build_view` is pure: raw keys in, a `ClusterView` out, with every key that does not
decode (or contradicts its topic) listed in `problems` rather than raised. `Metadata`
does the writes, each one etcd transaction:
- a topic is created whole (meta and every partition's state) or not at all;
- a partition state changes only by compare-and-swap on the revision it was read at;
- a channel exists only under an existing topic;
- a topic's or channel's switches (trace; a topic's paused) change by compare-and-swap on
  its key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable

from . import keys
from .etcd import Etcd, KeyValue, absent, exists, put_op, unchanged
from .state import BadValue, ChannelMeta, LookupdInfo, NodeInfo, PartitionState, TopicMeta


MAX_BATCH = 100  # partition states in one update_partitions transaction


class TopicExists(Exception):
    """create_topic: the topic is already there."""


class TopicNotFound(Exception):
    """The topic has no meta in etcd."""


class Conflict(Exception):
    """A compare-and-swap lost: the value changed since it was read. Read it again."""


@dataclass(frozen=True)
class TopicView:
    """One topic as etcd holds it. `incarnation`: the etcd revision that created its meta
    key, so a topic deleted and made again under the same name is a different one (0: not
    known, a view made by hand)."""

    name: str
    meta: TopicMeta
    channels: dict[str, ChannelMeta] = field(default_factory=dict)
    partitions: dict[int, PartitionState] = field(default_factory=dict)
    leader_locks: dict[int, str] = field(default_factory=dict)
    incarnation: int = 0


@dataclass(frozen=True)
class ClusterView:
    """Everything under /nsq/<cluster>/ at one etcd revision."""

    revision: int
    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    lookupds: dict[str, LookupdInfo] = field(default_factory=dict)
    master: str | None = None
    topics: dict[str, TopicView] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # each node's registration: the lease of its key (a restart registers under a new one,
    # even within the old one's TTL)
    registrations: dict[str, int] = field(default_factory=dict)

    @property
    def racks(self) -> dict[str, str]:
        """Each live node's rack (the failure domain placement keeps replicas apart in)."""
        return {n: info.rack for n, info in self.nodes.items()}

    def leaderless(self) -> list[tuple[str, int]]:
        """(topic, partition) whose leader is none or not a registered node."""
        return [(t.name, n) for t in self.topics.values()
                for n, s in sorted(t.partitions.items()) if s.leader not in self.nodes]


def decode_kv(cluster: str, kv: KeyValue) -> tuple[str, str | None, object, object] | None:
    """One key of the cluster prefix -> (kind, topic, detail, value), None if not ours.

    kind: node, lookupd, master, meta, channel, state, leader. Raises BadValue."""
    nodes_prefix = keys.nodes_prefix(cluster)
    lookupd_prefix = keys.lookupd_prefix(cluster)
    if kv.key.startswith(nodes_prefix):
        node_id = kv.key[len(nodes_prefix):]
        return "node", None, node_id, NodeInfo.decode(kv.value, kv.key, node_id)
    if kv.key.startswith(lookupd_prefix):
        lookupd_id = kv.key[len(lookupd_prefix):]
        return "lookupd", None, lookupd_id, LookupdInfo.decode(kv.value, kv.key)
    if kv.key == keys.lookupd_master(cluster):
        return "master", None, None, kv.value.decode("utf-8", "replace")
    parsed = keys.parse_topic_key(cluster, kv.key)
    if parsed is None:
        return None
    topic, kind, detail = parsed
    if kind == "meta":
        return kind, topic, detail, TopicMeta.decode(kv.value, kv.key)
    if kind == "channel":
        return kind, topic, detail, ChannelMeta.decode(kv.value, kv.key)
    if kind == "state":
        return kind, topic, detail, PartitionState.decode(kv.value, kv.key, kv.mod_revision)
    return kind, topic, detail, kv.value.decode("utf-8", "replace")


def build_view(cluster: str, kvs: Iterable[KeyValue], revision: int,
               cache: dict[str, tuple[int, object]] | None = None) -> ClusterView:
    """Decode a read of the cluster prefix; what does not decode goes to `problems`.

    `cache` (key -> (mod_revision, decode_kv's result or its BadValue)) spares decoding
    the keys that did not change since the last call; the caller drops deleted keys."""
    nodes: dict[str, NodeInfo] = {}
    registrations: dict[str, int] = {}
    lookupds: dict[str, LookupdInfo] = {}
    master = None
    problems: list[str] = []
    metas: dict[str, TopicMeta] = {}
    incarnations: dict[str, int] = {}
    channels: dict[str, dict[str, ChannelMeta]] = {}
    states: dict[str, dict[int, PartitionState]] = {}
    locks: dict[str, dict[int, str]] = {}
    for kv in kvs:
        hit = cache.get(kv.key) if cache is not None else None
        if hit is not None and hit[0] == kv.mod_revision:
            decoded = hit[1]
        else:
            try:
                decoded = decode_kv(cluster, kv)
            except BadValue as e:
                decoded = e
            if cache is not None:
                cache[kv.key] = (kv.mod_revision, decoded)
        if decoded is None:
            continue
        if isinstance(decoded, BadValue):
            problems.append(str(decoded))
            continue
        kind, topic, detail, value = decoded
        if kind == "node":
            nodes[detail] = value
            registrations[detail] = kv.lease
        elif kind == "lookupd":
            lookupds[detail] = value
        elif kind == "master":
            master = value
        elif kind == "meta":
            metas[topic] = value
            incarnations[topic] = kv.create_revision
        elif kind == "channel":
            channels.setdefault(topic, {})[detail] = value
        elif kind == "state":
            states.setdefault(topic, {})[detail] = value
        else:
            locks.setdefault(topic, {})[detail] = value
    topics: dict[str, TopicView] = {}
    for name in sorted(metas.keys() | states.keys() | channels.keys()):
        meta = metas.get(name)
        if meta is None:
            problems.append(f"{keys.topics_prefix(cluster)}{name}/: keys without a meta")
            continue
        parts = states.get(name, {})
        for n in sorted(parts):
            if n >= meta.partitions:
                problems.append(f"{keys.partition_state(cluster, name, n)}: partition "
                                f"{n} beyond the topic's {meta.partitions}")
                del parts[n]
        missing = [n for n in range(meta.partitions) if n not in parts]
        if missing:
            problems.append(f"{keys.topic_prefix(cluster, name)}: no state for "
                            f"partitions {missing[:10]}")
        topics[name] = TopicView(name, meta, channels.get(name, {}), parts,
                                 locks.get(name, {}), incarnations[name])
    return ClusterView(revision, nodes, lookupds, master, topics, problems, registrations)


def initial_states(placement: list[list[str]]) -> list[PartitionState]:
    """A new topic's partition states: leader first in its replicas, all of them in sync."""
    return [PartitionState(leader=replicas[0], isr=tuple(replicas), epoch=1)
            for replicas in placement]


class Metadata:
    """Reads and writes the metadata of cluster `cluster` through `etcd`."""

    def __init__(self, etcd: Etcd, cluster: str):
        self.etcd = etcd
        self.cluster = keys.check_cluster(cluster)

    async def read(self) -> ClusterView:
        """The whole cluster, from one consistent read."""
        kvs, revision = await self.etcd.get_prefix(keys.cluster_prefix(self.cluster))
        return build_view(self.cluster, kvs, revision)

    async def create_topic(self, topic: str, meta: TopicMeta,
                           placement: list[list[str]]) -> int:
        """Write meta and every partition state in one transaction: the revision.

        Raises TopicExists if the topic has a meta; EtcdRefused if the transaction has
        more operations than etcd's --max-txn-ops allows (default 128: start etcd with
        --max-txn-ops 2048 for topics of up to 1024 partitions)."""
        if len(placement) != meta.partitions or any(len(r) != meta.replicas for r in placement):
            raise ValueError(f"placement does not match {meta.partitions} partitions of "
                             f"{meta.replicas} replicas")
        meta_key = keys.topic_meta(self.cluster, topic)
        ops = [put_op(meta_key, meta.encode())]
        ops += [put_op(keys.partition_state(self.cluster, topic, n), state.encode())
                for n, state in enumerate(initial_states(placement))]
        ok, revision = await self.etcd.txn([absent(meta_key)], ops)
        if not ok:
            raise TopicExists(topic)
        return revision

    async def delete_topic(self, topic: str) -> bool:
        """Delete the topic and everything under it (one revision): whether it was there."""
        return await self.etcd.delete_prefix(keys.topic_prefix(self.cluster, topic)) > 0

    async def create_channel(self, topic: str, channel: str, meta: ChannelMeta) -> bool:
        """Add the channel to every partition of the topic: False if it was there already.
        Raises TopicNotFound."""
        meta_key = keys.topic_meta(self.cluster, topic)
        key = keys.channel(self.cluster, topic, channel)
        ok, _ = await self.etcd.txn([exists(meta_key), absent(key)],
                                    [put_op(key, meta.encode())])
        if ok:
            return True
        kv, _ = await self.etcd.get(meta_key)
        if kv is None:
            raise TopicNotFound(topic)
        return False

    async def set_switch(self, topic: str, channel: str | None, switch: str, on: bool) -> int:
        """Set `switch` (`trace`; a topic's `paused`) in the topic's meta (channel None) or
        in the channel's meta, by CAS on the key (read again after a conflict): the revision
        that holds it, or 0 when the key does not exist. Raises Conflict after 10 conflicts
        in a row."""
        key = (keys.topic_meta(self.cluster, topic) if channel is None
               else keys.channel(self.cluster, topic, channel))
        kind = TopicMeta if channel is None else ChannelMeta
        for _ in range(10):
            kv, _ = await self.etcd.get(key)
            if kv is None:
                return 0
            meta = kind.decode(kv.value, key)
            if getattr(meta, switch) == on:
                return kv.mod_revision
            ok, revision = await self.etcd.txn(
                [unchanged(key, kv.mod_revision)],
                [put_op(key, dataclasses.replace(meta, **{switch: on}).encode())])
            if ok:
                return revision
        raise Conflict(f"{key}: changed by others 10 times in a row")

    async def delete_channel(self, topic: str, channel: str) -> bool:
        return await self.etcd.delete(keys.channel(self.cluster, topic, channel)) > 0

    async def read_partition(self, topic: str, partition: int) -> PartitionState | None:
        """The partition's state with its revision (None if absent); BadValue if malformed."""
        key = keys.partition_state(self.cluster, topic, partition)
        kv, _ = await self.etcd.get(key)
        return None if kv is None else PartitionState.decode(kv.value, key, kv.mod_revision)

    async def update_partition(self, topic: str, partition: int,
                               new: PartitionState) -> PartitionState:
        """Write `new` if the state is still at `new.revision` (the revision it was read at):
        the written state with its new revision. Raises Conflict if it changed, or if the
        topic's meta is gone (a deleted topic is never brought back by a late update)."""
        if new.revision <= 0:
            raise ValueError("update_partition needs the revision the state was read at")
        key = keys.partition_state(self.cluster, topic, partition)
        meta_key = keys.topic_meta(self.cluster, topic)
        ok, revision = await self.etcd.txn([unchanged(key, new.revision), exists(meta_key)],
                                           [put_op(key, new.encode())])
        if not ok:
            raise Conflict(f"{key}: changed since revision {new.revision}")
        return new.evolve(revision=revision)

    async def update_partitions(self, topic: str, new: dict[int, PartitionState]
                                ) -> dict[int, PartitionState]:
        """`update_partition` of several partitions of one topic in one transaction: all
        written, or none and Conflict (at most MAX_BATCH at once: etcd's default
        --max-txn-ops is 128 compares)."""
        if not 0 < len(new) <= MAX_BATCH or any(s.revision <= 0 for s in new.values()):
            raise ValueError(f"1..{MAX_BATCH} states, each with the revision it was read at")
        compares = [exists(keys.topic_meta(self.cluster, topic))]
        ops = []
        for n, state in sorted(new.items()):
            key = keys.partition_state(self.cluster, topic, n)
            compares.append(unchanged(key, state.revision))
            ops.append(put_op(key, state.encode()))
        ok, revision = await self.etcd.txn(compares, ops)
        if not ok:
            raise Conflict(f"{keys.topic_prefix(self.cluster, topic)}: a state of "
                           f"{sorted(new)[:10]} changed")
        return {n: state.evolve(revision=revision) for n, state in new.items()}

