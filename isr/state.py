"""The values stored in etcd, as frozen dataclasses with strict JSON codecs.

`decode` accepts exactly the fields `encode` writes, each of its type and in its range;
anything else (not JSON, a field missing, one unknown, a wrong type, a broken invariant)
raises `BadValue` naming the key and the reason, which callers report and skip: a stale,
partial or malformed value in etcd never crashes a daemon. Revisions are etcd's, not
part of a value: `PartitionState.revision` is the mod_revision it was read at (0: not
read from etcd), the one its compare-and-swap must match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from nsqwire.protocol import decode_json

from .keys import BadName, check_node_id

MAX_PARTITIONS = 1024
MAX_REPLICAS = 5


class BadValue(ValueError):
    """A value in etcd that does not decode: `key` and `reason` say which and why."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


def _int(lo: int, hi: int | None = None) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and v >= lo and (hi is None or v <= hi)


def _bool(v: Any) -> bool:
    return type(v) is bool


def _text(v: Any) -> bool:
    return type(v) is str and len(v) <= 255


def _node_id(v: Any) -> bool:
    if type(v) is not str:
        return False
    try:
        check_node_id(v)
    except BadName:
        return False
    return True


def _address(v: Any) -> bool:
    """host:port with a port in 1..65535 (the same shape as a node id)."""
    return _node_id(v)


def _node_ids(v: Any) -> bool:
    return type(v) is list and all(_node_id(x) for x in v) and len(set(v)) == len(v)


def _optional_node_id(v: Any) -> bool:
    return v is None or _node_id(v)


def _decode(key: str, raw: bytes, checks: dict[str, Callable[[Any], bool]],
            defaults: Callable[[dict], dict] | None = None) -> dict:
    """The checked fields of a value; `defaults(obj)` gives the fields an older writer
    left out (and only those)."""
    try:
        obj = decode_json(raw)
    except ValueError as e:
        raise BadValue(key, f"not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise BadValue(key, f"not a JSON object: {raw[:80]!r}")
    if defaults is not None:
        obj = {**defaults(obj), **obj}
    missing = sorted(checks.keys() - obj.keys())
    if missing:
        raise BadValue(key, f"missing {', '.join(missing)}")
    unknown = sorted(obj.keys() - checks.keys())
    if unknown:
        raise BadValue(key, f"unknown field {', '.join(unknown)}")
    for name, check in checks.items():
        if not check(obj[name]):
            raise BadValue(key, f"bad {name}: {obj[name]!r:.80}")
    return obj


def _encode(value) -> bytes:
    body = {f.name: getattr(value, f.name) for f in fields(value) if f.metadata.get("json", True)}
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def _default_rack(obj: dict) -> dict:
    """A node's rack when none is given: the host part of its TCP address."""
    tcp = obj.get("tcp")
    return {"rack": tcp.rpartition(":")[0]} if isinstance(tcp, str) else {}


@dataclass(frozen=True)
class NodeInfo:
    """An nsqd node, at nodes/<id> under its lease. `id` is its `tcp` address. `rack`: the
    failure domain placement keeps a partition's replicas apart in (nsqd --rack; the host
    part of its address by default, and for a node registered before racks existed)."""

    id: str
    tcp: str
    http: str
    rpc: str
    hostname: str
    version: str
    rack: str = ""

    CHECKS = {"id": _node_id, "tcp": _address, "http": _address, "rpc": _address,
              "hostname": _text, "version": _text, "rack": _text}

    def __post_init__(self):
        if not self.rack:
            object.__setattr__(self, "rack", _default_rack({"tcp": self.tcp})["rack"])
        _validate(self, "NodeInfo")
        if self.id != self.tcp:
            raise BadValue("NodeInfo", f"id {self.id!r} is not the tcp address {self.tcp!r}")

    def encode(self) -> bytes:
        return _encode(self)

    @classmethod
    def decode(cls, raw: bytes, key: str = "node", node_id: str | None = None) -> "NodeInfo":
        """node_id: the id in the key, which the value must repeat."""
        obj = _decode(key, raw, cls.CHECKS, _default_rack)
        if node_id is not None and obj["id"] != node_id:
            raise BadValue(key, f"id {obj['id']!r} does not match its key")
        return _build(cls, key, obj)


@dataclass(frozen=True)
class LookupdInfo:
    """An nsqlookupd, at lookupd/nodes/<id> under its lease. `id` is its `tcp` address."""

    id: str
    tcp: str
    http: str
    hostname: str
    version: str

    CHECKS = {"id": _node_id, "tcp": _address, "http": _address,
              "hostname": _text, "version": _text}

    def __post_init__(self):
        _validate(self, "LookupdInfo")

    def encode(self) -> bytes:
        return _encode(self)

    @classmethod
    def decode(cls, raw: bytes, key: str = "lookupd") -> "LookupdInfo":
        return _build(cls, key, _decode(key, raw, cls.CHECKS))


def default_min_isr(replicas: int) -> int:
    """A majority of the replicas: what a topic needs in sync to take a publish."""
    return replicas // 2 + 1


@dataclass(frozen=True)
class TopicMeta:
    """A topic's settings, at topics/<t>/meta; written when the topic is created, and
    after only its switches `trace` and `paused` change (Metadata.set_switch, by CAS).

    min_isr <= replicas; retention_ms 0 means the nodes' own retention flags; trace: its
    leaders record trace events of it and all its channels (nsqd/tracing.py); paused: its
    leaders deliver none of it (/topic/pause), whichever node leads.
    """

    partitions: int
    replicas: int = 1
    min_isr: int = 1
    sync_every: int = 1
    sync_timeout_ms: int = 2000
    retention_ms: int = 0
    ordered: bool = False
    ext: bool = False
    trace: bool = False
    paused: bool = False

    CHECKS = {"partitions": _int(1, MAX_PARTITIONS), "replicas": _int(1, MAX_REPLICAS),
              "min_isr": _int(1, MAX_REPLICAS), "sync_every": _int(1),
              "sync_timeout_ms": _int(0), "retention_ms": _int(0),
              "ordered": _bool, "ext": _bool, "trace": _bool, "paused": _bool}

    def __post_init__(self):
        _validate(self, "TopicMeta")
        if self.min_isr > self.replicas:
            raise BadValue("TopicMeta", f"min_isr {self.min_isr} > replicas {self.replicas}")

    def encode(self) -> bytes:
        return _encode(self)

    @classmethod
    def decode(cls, raw: bytes, key: str = "meta") -> "TopicMeta":
        return _build(cls, key, _decode(key, raw, cls.CHECKS))


@dataclass(frozen=True)
class ChannelMeta:
    """A channel of every partition of its topic, at topics/<t>/channels/<c>."""

    ordered: bool = False
    trace: bool = False
    # written by earlier versions (the creating node's wall clock), still decoded; nothing
    # writes or reads it now: a channel's start never comes from a clock (nsqd/README.md)
    created_ms: int = 0

    CHECKS = {"ordered": _bool, "trace": _bool, "created_ms": _int(0)}

    def __post_init__(self):
        _validate(self, "ChannelMeta")

    def encode(self) -> bytes:
        return _encode(self)

    @classmethod
    def decode(cls, raw: bytes, key: str = "channel") -> "ChannelMeta":
        return _build(cls, key, _decode(key, raw, cls.CHECKS))


@dataclass(frozen=True)
class PartitionState:
    """Who serves a partition, at topics/<t>/p/<n>/state; changed only by CAS on `revision`.

    Invariants: the leader (None: leaderless) is in the ISR; no node twice in the ISR;
    catchup is disjoint from the ISR; a new leader or ISR comes with a higher epoch.
    """

    leader: str | None
    isr: tuple[str, ...]
    catchup: tuple[str, ...] = ()
    epoch: int = 1
    revision: int = field(default=0, compare=False, metadata={"json": False})

    CHECKS = {"leader": _optional_node_id, "isr": _node_ids, "catchup": _node_ids,
              "epoch": _int(0)}

    def __post_init__(self):
        object.__setattr__(self, "isr", tuple(self.isr))
        object.__setattr__(self, "catchup", tuple(self.catchup))
        _validate(self, "PartitionState", as_list=("isr", "catchup"))
        if self.leader is not None and self.leader not in self.isr:
            raise BadValue("PartitionState", f"leader {self.leader!r} not in isr {list(self.isr)}")
        if set(self.isr) & set(self.catchup):
            raise BadValue("PartitionState", "a node is both in isr and catchup")
        if type(self.revision) is not int or self.revision < 0:
            raise BadValue("PartitionState", f"bad revision {self.revision!r}")

    def encode(self) -> bytes:
        body = {"leader": self.leader, "isr": list(self.isr), "catchup": list(self.catchup),
                "epoch": self.epoch}
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str = "state", revision: int = 0) -> "PartitionState":
        obj = _decode(key, raw, cls.CHECKS)
        return _build(cls, key, obj, revision=revision)

    def evolve(self, **changes) -> "PartitionState":
        """A copy with `changes` (validated), keeping the revision to compare against."""
        return replace(self, **changes)


def _validate(value, what: str, as_list: tuple[str, ...] = ()) -> None:
    for name, check in value.CHECKS.items():
        v = getattr(value, name)
        if name in as_list:
            v = list(v)
        if not check(v):
            raise BadValue(what, f"bad {name}: {v!r:.80}")


def _build(cls, key: str, obj: dict, **extra):
    try:
        return cls(**obj, **extra)
    except BadValue as e:
        raise BadValue(key, e.reason) from None
