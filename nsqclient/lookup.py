"""Where a topic's partitions are led: the answer of nsqlookupd's `/lookup`, typed.

`parse_lookup` is sans-I/O: (HTTP status, body) in, a TopicMap or a clear error out,
whatever the bytes. A lookup source is anything with `async lookup(topic, access)`:
`LookupdSource` asks a list of nsqlookupd HTTP addresses (each in turn, bounded
timeouts); `StaticLookup` is a fixed map for a user who knows their nodes (as pynsq's
`nsqd_tcp_addresses`), which tests also change by hand to move a leader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
import structlog

log = structlog.get_logger("nsqclient.lookup")

MAX_ANSWER_BYTES = 4 << 20


class LookupFailed(Exception):
    """No lookup source gave a usable answer; the message says why, per source."""


class TopicNotFound(LookupFailed):
    """Every source that answered says the topic does not exist."""


@dataclass(frozen=True, order=True)
class Node:
    """An nsqd's TCP address as clients dial it (broadcast_address, tcp_port)."""
    host: str
    tcp_port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.tcp_port}"

    @classmethod
    def parse(cls, address: str) -> "Node":
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"not a host:port address: {address!r}")
        return cls(host, int(port))


@dataclass(frozen=True)
class TopicMap:
    """One lookup's view of a topic.

    partition_num is None for a classic topic (an answer without `partitions`): publish
    without a partition number to any of `producers`. Otherwise `leaders` maps each
    partition that has a live leader to it; a leaderless partition is absent."""
    topic: str
    partition_num: int | None
    ordered: bool = False
    leaders: dict[int, Node] = field(default_factory=dict)
    producers: tuple[Node, ...] = ()


def _node(value, where: str) -> Node:
    if not isinstance(value, dict):
        raise LookupFailed(f"{where} is not an object")
    host, port = value.get("broadcast_address"), value.get("tcp_port")
    if not isinstance(host, str) or not host:
        raise LookupFailed(f"{where} has no broadcast_address")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise LookupFailed(f"{where} has no valid tcp_port")
    return Node(host, port)


def parse_lookup(topic: str, status: int, body: bytes) -> TopicMap:
    """The TopicMap in a `/lookup` answer, bare or in the legacy
    `{"status_code", "status_txt", "data"}` envelope. Raises TopicNotFound for
    TOPIC_NOT_FOUND, LookupFailed for anything else that is not a usable answer."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise LookupFailed(f"HTTP {status}, not JSON: {body[:80]!r}") from None
    if isinstance(doc, dict) and "status_code" in doc and "data" in doc:  # legacy envelope
        code = doc["status_code"]
        status = code if isinstance(code, int) and not isinstance(code, bool) else status
        message = doc.get("status_txt")
        doc = doc["data"] if status == 200 else {"message": message}
    if status != 200:
        message = doc.get("message") if isinstance(doc, dict) else None
        if message == "TOPIC_NOT_FOUND":
            raise TopicNotFound(f"topic {topic!r} not found")
        raise LookupFailed(f"HTTP {status}: " + (message if isinstance(message, str) else repr(body[:80])))
    if not isinstance(doc, dict):
        raise LookupFailed("the answer is not a JSON object")
    producers = doc.get("producers", [])
    if not isinstance(producers, list):
        raise LookupFailed("producers is not a list")
    nodes = tuple(dict.fromkeys(_node(p, f"producers[{i}]") for i, p in enumerate(producers)))
    partitions = doc.get("partitions")
    if partitions is None:
        return TopicMap(topic, None, producers=nodes)
    if not isinstance(partitions, dict):
        raise LookupFailed("partitions is not an object")
    meta = doc.get("meta")
    if not isinstance(meta, dict):
        raise LookupFailed("partitions without meta")
    num = meta.get("partition_num")
    if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= 1024:
        raise LookupFailed(f"meta.partition_num is not 1..1024: {num!r}")
    leaders = {}
    for key, value in partitions.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= num:
            raise LookupFailed(f"partition {key!r} is not in 0..{num - 1}")
        leaders[int(key)] = _node(value, f"partitions[{key}]")
    return TopicMap(topic, num, bool(meta.get("ordered", False)), leaders,
                    nodes or tuple(dict.fromkeys(leaders.values())))


class LookupSource(Protocol):
    async def lookup(self, topic: str, access: str) -> TopicMap: ...

    async def close(self) -> None: ...


class LookupdSource:
    """Asks `/lookup?topic=T&access=r|w` of each nsqlookupd in turn; the first usable
    answer wins. TopicNotFound only when every lookupd that answered said so."""

    def __init__(self, http_addresses: list[str], timeout: float = 2.0):
        if not http_addresses:
            raise ValueError("at least one lookupd HTTP address is needed")
        self.http_addresses = list(http_addresses)
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._next = 0

    async def lookup(self, topic: str, access: str = "w") -> TopicMap:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers={"Accept": "application/vnd.nsq; version=1.0"})
        failures, not_found = [], None
        n = len(self.http_addresses)
        start, self._next = self._next, (self._next + 1) % n  # spread the load
        for i in range(n):
            address = self.http_addresses[(start + i) % n]
            try:
                status, body = await self._get(address, topic, access)
                return parse_lookup(topic, status, body)
            except TopicNotFound as e:
                not_found = e
            except (LookupFailed, aiohttp.ClientError, OSError, TimeoutError) as e:
                failures.append(f"{address}: {e or type(e).__name__}")
        if not_found is not None:
            raise TopicNotFound("; ".join([str(not_found), *failures]))
        raise LookupFailed(f"lookup of topic {topic!r} failed: " + "; ".join(failures))

    async def _get(self, address: str, topic: str, access: str) -> tuple[int, bytes]:
        url = f"http://{address}/lookup"
        async with self._session.get(url, params={"topic": topic, "access": access}) as r:
            body = await r.content.read(MAX_ANSWER_BYTES + 1)
            if len(body) > MAX_ANSWER_BYTES:
                raise LookupFailed(f"answer larger than {MAX_ANSWER_BYTES} bytes")
            return r.status, body

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class StaticLookup:
    """A fixed partition map per topic, set by the caller (`set`); no network."""

    def __init__(self):
        self._maps: dict[str, TopicMap] = {}

    def set(self, topic: str, partition_num: int | None, leaders: dict[int, str] | None = None,
            producers: list[str] = ()) -> None:
        """A partitioned topic (`leaders`: partition -> "host:port"), or with
        partition_num None a classic one served by `producers`."""
        nodes = {n: Node.parse(a) for n, a in (leaders or {}).items()}
        if partition_num is not None and any(not 0 <= n < partition_num for n in nodes):
            raise ValueError(f"a partition outside 0..{partition_num - 1}")
        listed = tuple(Node.parse(a) for a in producers)
        self._maps[topic] = TopicMap(topic, partition_num, False, nodes,
                                     listed or tuple(dict.fromkeys(nodes.values())))

    async def lookup(self, topic: str, access: str = "w") -> TopicMap:
        if topic not in self._maps:
            raise TopicNotFound(f"topic {topic!r} not in the static map")
        return self._maps[topic]

    async def close(self) -> None:
        pass


def lookup_source(lookupd_http_addresses: list[str] | None, lookup: LookupSource | None) -> LookupSource:
    """Exactly one of the two: lookupd addresses (production) or a source."""
    if (lookupd_http_addresses is None) == (lookup is None):
        raise ValueError("give lookupd_http_addresses or lookup, not both or neither")
    return lookup if lookup is not None else LookupdSource(lookupd_http_addresses)
