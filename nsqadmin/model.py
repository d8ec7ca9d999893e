"""The cluster as nsqadmin sees it: a Snapshot built, by pure functions, from what one poll
read over HTTP (nsqlookupd /nodes /topics /info, every nsqd's /stats?format=json and
/info, nsqlookupd /cluster/stats). Nothing here does I/O; source.py fetches, this builds,
views.py and pages.py read. A Snapshot is never changed after build().

Where a number comes from:
- a partition's leader, ISR and epoch: the leading node's `cluster.replication.leading`;
  its catch-up list: the nodes that follow the partition (`following`) outside the ISR;
- a partition's `messages`: its leader's `committed_count`, the messages committed to
  its log since the partition was made; a position in the replicated log, so every
  replica reports the same count and it does not restart when the leader changes; its
  `depth`: the largest depth of its channels (the backlog of the slowest channel), or the
  topic partition's own depth without channels;
- a channel's `confirmed_count`: the sum over its partitions of the cursor's
  `confirmed_count` (the messages of the partition's history before the channel's first
  unfinished one), which the channel's checkpoint carries to the followers: it survives a
  leader change as the partition's count does (a replay moves it back);
- a channel's `max_attempts`: the largest of its partitions' (each node reports its own);
- the other channel numbers (`dead` among them): the sum over the nodes that serve its
  partitions;
- a partition's half messages (`half_waiting`, `half_committed`, `half_rolled_back`,
  `half_checks`, `half_expired`): its leader's, counted since the partition opened on it
  (a new leader counts afresh from the log's tail); a topic's: the sums over its
  partitions.

In cluster mode a partition is counted once: when two nodes report leading it (a leader
change between the two /stats reads of one poll), the one with the higher epoch is kept
and so are only its channel numbers. In the classic modes each nsqd's partition is a log
of its own, and every one counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("cluster", "classic", "nsqd")


@dataclass
class Node:
    http: str  # host:port of its HTTP API: the key nsqadmin names a node by
    tcp: str = ""
    node_id: str = ""  # cluster mode: host:tcp_port as in ISR lists
    hostname: str = ""
    version: str = ""
    error: str = ""  # why it could not be read ("" when read)
    health: str = ""
    start_time: int = 0
    clients: int = 0
    topics: list[str] = field(default_factory=list)
    tombstones: dict[str, bool] = field(default_factory=dict)
    partitions_led: int = 0
    leading: list[tuple[str, int]] = field(default_factory=list)
    following: list[tuple[str, int]] = field(default_factory=list)
    etcd_connected: bool | None = None
    lease_ok: bool | None = None
    trace: dict = field(default_factory=dict)
    load: dict | None = None


@dataclass
class Partition:
    topic: str
    number: int
    leader: str = ""  # HTTP address of the node serving it ("" when none answered)
    leader_id: str = ""
    isr: list[str] = field(default_factory=list)  # node ids
    catchup: list[str] = field(default_factory=list)
    epoch: int | None = None
    writable: bool | None = None
    reason: str = ""
    messages: int = 0
    size_bytes: int = 0
    depth: int = 0
    channels: list[str] = field(default_factory=list)
    error: str = ""
    half_waiting: int = 0  # half messages waiting for their decision (nsqd's halves)
    half_committed: int = 0
    half_rolled_back: int = 0
    half_checks: int = 0  # check-backs made to producers
    half_expired: int = 0  # rolled back after their last check-back got no decision


HALF_FIELDS = ("half_waiting", "half_committed", "half_rolled_back", "half_checks",
               "half_expired")


@dataclass
class ChannelPart:
    """One partition of a channel, as its serving node reports it."""
    partition: int
    node: str
    depth: int
    in_flight: int
    deferred: int
    delayed: int
    requeued: int
    timed_out: int
    paused: bool
    ordered: bool
    confirmed: int
    confirmed_count: int
    next_read: int
    dead: int  # dead letters kept (nsqd's `dead_count`)
    max_attempts: int  # deliveries after which a message is buried (0: never)


@dataclass
class Channel:
    topic: str
    name: str
    depth: int = 0
    in_flight: int = 0
    deferred: int = 0
    delayed: int = 0
    requeued: int = 0
    timed_out: int = 0
    confirmed_count: int = 0
    dead: int = 0  # dead letters, summed over its partitions
    max_attempts: int = 0  # the largest of its partitions' (0: none buries)
    paused: bool = False
    ordered: bool = False
    traced: bool = False
    clients: list[dict] = field(default_factory=list)  # nsqd's client entries + `node`
    parts: list[ChannelPart] = field(default_factory=list)


@dataclass
class Topic:
    name: str
    partition_num: int = 0
    ordered: bool = False
    paused: bool = False
    traced: bool = False
    messages: int = 0
    depth: int = 0
    partitions: list[Partition] = field(default_factory=list)
    channels: dict[str, Channel] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)  # HTTP addresses holding it
    half_waiting: int = 0  # half messages (HALF_FIELDS): the sums over its partitions
    half_committed: int = 0
    half_rolled_back: int = 0
    half_checks: int = 0
    half_expired: int = 0


@dataclass
class Snapshot:
    mode: str  # one of MODES
    taken_at: float
    nodes: dict[str, Node]
    topics: dict[str, Topic]
    lookupds: list[dict]  # {address, info, error, master}
    load: dict | None  # /cluster/stats's answer, None when no lookupd gave one
    load_note: str  # why there is no load ("" when there is)
    problems: list[str]

    @property
    def node_by_id(self) -> dict[str, Node]:
        return {n.node_id: n for n in self.nodes.values() if n.node_id}

    def master_lookupd(self) -> str:
        """The HTTP address to send cluster writes to: the master's, else the first lookupd."""
        for lk in self.lookupds:
            cluster = (lk.get("info") or {}).get("cluster") or {}
            if cluster.get("master_http_address"):
                return cluster["master_http_address"]
        return self.lookupds[0]["address"] if self.lookupds else ""


def _int(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def producer_http(p: dict) -> str:
    return f"{p.get('broadcast_address')}:{p.get('http_port')}"


def _node(http: str, stats: dict | None, info: dict | None, producer: dict | None,
          error: str) -> Node:
    node = Node(http=http, error=error)
    if producer:
        node.tcp = f"{producer.get('broadcast_address')}:{producer.get('tcp_port')}"
        node.hostname = producer.get("hostname", "")
        node.version = producer.get("version", "")
        node.topics = list(producer.get("topics") or [])
        node.tombstones = dict(zip(node.topics, producer.get("tombstones") or []))
    if info:
        node.tcp = node.tcp or f"{info.get('broadcast_address')}:{info.get('tcp_port')}"
        node.hostname = node.hostname or info.get("hostname", "")
        node.version = node.version or info.get("version", "")
        node.node_id = info.get("node_id", "")
    if not stats:
        return node
    node.version = node.version or stats.get("version", "")
    node.health = stats.get("health", "")
    node.start_time = _int(stats.get("start_time"))
    node.clients = _int(stats.get("client_count"))
    names = [t.get("topic_name", "") for t in stats.get("topics") or ()]
    node.topics = sorted(set(node.topics) | set(names))
    node.trace = stats.get("trace") or {}
    cluster = stats.get("cluster") or {}
    if cluster:
        node.node_id = cluster.get("node_id") or node.node_id
        node.etcd_connected = cluster.get("etcd_connected")
        node.lease_ok = cluster.get("lease_ok")
        repl = cluster.get("replication") or {}
        node.leading = sorted(_split_key(k) for k in repl.get("leading") or {})
        node.following = sorted(_split_key(k) for k in repl.get("following") or {})
        node.partitions_led = _int(cluster.get("partitions_led"))
    else:
        node.leading = sorted((t.get("topic_name", ""), p.get("partition", 0))
                              for t in stats.get("topics") or ()
                              for p in t.get("partitions") or () if p.get("leader"))
        node.partitions_led = len(node.leading)
    return node


def _split_key(key: str) -> tuple[str, int]:
    topic, _, n = key.rpartition("/")
    return topic, int(n) if n.isdigit() else -1


def _traced(trace: dict, topic: str, channel: str | None = None) -> bool:
    if trace.get("trace_all"):
        return True
    if channel is None:
        return topic in (trace.get("topics") or ())
    return f"{topic}/{channel}" in (trace.get("channels") or ())


def _add_channel(topic: Topic, node: Node, c: dict, trace: dict) -> None:
    name = c.get("channel_name", "")
    ch = topic.channels.get(name)
    if ch is None:
        ch = topic.channels[name] = Channel(topic=topic.name, name=name)
    ch.traced = ch.traced or _traced(trace, topic.name) or _traced(trace, topic.name, name)
    ch.clients += [{**cl, "node": node.http} for cl in c.get("clients") or ()]
    parts = c.get("partitions")
    if parts is None:  # a node without partitions in its stats: one row for the whole
        parts = [{"partition": 0, **c}]
    for p in parts:
        ch.parts.append(ChannelPart(
            partition=_int(p.get("partition")), node=node.http, depth=_int(p.get("depth")),
            in_flight=_int(p.get("in_flight_count")), deferred=_int(p.get("deferred_count")),
            delayed=_int(p.get("delayed_count")), requeued=_int(p.get("requeue_count")),
            timed_out=_int(p.get("timeout_count")), paused=bool(p.get("paused")),
            ordered=bool(p.get("ordered")), confirmed=_int(p.get("confirmed")),
            confirmed_count=_int(p.get("confirmed_count")),
            next_read=_int(p.get("next_read")), dead=_int(p.get("dead_count")),
            max_attempts=_int(p.get("max_attempts"))))


def _sum_channel(ch: Channel) -> None:
    """The channel's numbers from its parts (after a partition claimed twice is dropped)."""
    for cp in ch.parts:
        ch.depth += cp.depth
        ch.in_flight += cp.in_flight
        ch.deferred += cp.deferred
        ch.delayed += cp.delayed
        ch.requeued += cp.requeued
        ch.timed_out += cp.timed_out
        ch.confirmed_count += cp.confirmed_count
        ch.dead += cp.dead
        ch.max_attempts = max(ch.max_attempts, cp.max_attempts)
        ch.paused = ch.paused or cp.paused
        ch.ordered = ch.ordered or cp.ordered


def _one_leader_each(topic: Topic) -> None:
    """Cluster mode: one Partition per number, the claim with the higher epoch (the newer
    leader), and only the kept leaders' channel parts."""
    kept: dict[int, Partition] = {}
    for p in topic.partitions:
        old = kept.get(p.number)
        if old is None or (p.epoch or 0) > (old.epoch or 0):
            kept[p.number] = p
    topic.partitions = list(kept.values())
    for ch in topic.channels.values():
        ch.parts = [cp for cp in ch.parts
                    if cp.partition not in kept or kept[cp.partition].leader == cp.node]


def _add_topic(topics: dict[str, Topic], node: Node, t: dict, leading: dict,
               following: dict[tuple[str, int], list[str]]) -> None:
    name = t.get("topic_name", "")
    topic = topics.get(name)
    if topic is None:
        topic = topics[name] = Topic(name=name)
    topic.nodes.append(node.http)
    topic.partition_num = max(topic.partition_num, _int(t.get("partition_num")) or 1)
    topic.ordered = topic.ordered or bool(t.get("ordered"))
    topic.paused = topic.paused or bool(t.get("paused"))
    topic.traced = topic.traced or _traced(node.trace, name)
    for c in t.get("channels") or ():
        _add_channel(topic, node, c, node.trace)
    parts = t.get("partitions")
    if parts is None:
        parts = [{"partition": 0, "leader": True, "depth": t.get("depth"),
                  "committed_count": t.get("message_count"), "channels": []}]
    for p in parts:
        if not p.get("leader"):
            continue
        n = _int(p.get("partition"))
        repl = leading.get(f"{name}/{n}") or {}
        isr = list(repl.get("isr") or ())
        topic.partitions.append(Partition(
            topic=name, number=n, leader=node.http, leader_id=node.node_id,
            isr=isr, catchup=[f for f in following.get((name, n), ()) if f not in isr],
            epoch=repl.get("epoch"), writable=repl.get("writable"),
            reason=repl.get("reason") or "",
            messages=_int(p.get("committed_count")),
            size_bytes=_int(p.get("committed_offset")) - _int(p.get("start_offset")),
            depth=_int(p.get("depth")), channels=list(p.get("channels") or ()),
            error=p.get("error") or "", **{k: _int(p.get(k)) for k in HALF_FIELDS}))


def build(mode: str, taken_at: float, lookupds: list[dict], producers: list[dict],
          lookupd_topics: list[str], stats: dict[str, dict | None], infos: dict[str, dict],
          errors: dict[str, str], load: dict | None, load_note: str) -> Snapshot:
    """The Snapshot of one poll. `producers`: lookupd /nodes entries (may be empty);
    `stats`, `infos`, `errors`: per node HTTP address."""
    by_http = {producer_http(p): p for p in producers}
    nodes: dict[str, Node] = {}
    for http in sorted(set(stats) | set(by_http)):
        nodes[http] = _node(http, stats.get(http), infos.get(http), by_http.get(http),
                            errors.get(http, ""))
    load_nodes = _load_by_node(load)
    for node in nodes.values():
        node.load = load_nodes.get(node.node_id) or load_nodes.get(node.tcp) or \
            load_nodes.get(node.http)
    following: dict[tuple[str, int], list[str]] = {}
    for node in nodes.values():
        for key in node.following:
            following.setdefault(key, []).append(node.node_id)
    topics: dict[str, Topic] = {}
    for http, s in stats.items():
        if not s:
            continue
        leading = ((s.get("cluster") or {}).get("replication") or {}).get("leading") or {}
        for t in s.get("topics") or ():
            _add_topic(topics, nodes[http], t, leading, following)
    for name in lookupd_topics:
        topics.setdefault(name, Topic(name=name))
    for topic in topics.values():
        if mode == "cluster":
            _one_leader_each(topic)
        topic.partitions.sort(key=lambda p: (p.number, p.leader))
        by_number: dict[int, list[ChannelPart]] = {}
        for ch in topic.channels.values():
            ch.parts.sort(key=lambda cp: (cp.partition, cp.node))
            _sum_channel(ch)
            for cp in ch.parts:
                by_number.setdefault(cp.partition, []).append(cp)
        for p in topic.partitions:
            here = [cp.depth for cp in by_number.get(p.number, ()) if cp.node == p.leader]
            p.depth = max(here) if here else p.depth
        topic.messages = sum(p.messages for p in topic.partitions)
        topic.depth = sum(p.depth for p in topic.partitions)
        for k in HALF_FIELDS:
            setattr(topic, k, sum(getattr(p, k) for p in topic.partitions))
        topic.partition_num = topic.partition_num or len(topic.partitions)
    problems = [f"{http}: {e}" for http, e in sorted(errors.items())]
    for lk in lookupds:
        if lk.get("error"):
            problems.append(f"nsqlookupd {lk['address']}: {lk['error']}")
        cluster = (lk.get("info") or {}).get("cluster") or {}
        problems += [f"nsqlookupd {lk['address']}: {p}" for p in cluster.get("problems") or ()]
    return Snapshot(mode=mode, taken_at=taken_at, nodes=nodes,
                    topics=dict(sorted(topics.items())), lookupds=lookupds, load=load,
                    load_note=load_note, problems=problems)


def _load_by_node(load: dict | None) -> dict[str, dict]:
    """Per node entries of a /cluster/stats answer (`node_stat_list`: [{id, broadcast_address,
    http_port, tcp_port, ...load factors}]), each under its id, TCP and HTTP addresses."""
    if not isinstance(load, dict):
        return {}
    entries = load.get("node_stat_list")
    out = {}
    for v in entries if isinstance(entries, list) else ():
        if not isinstance(v, dict):
            continue
        host = v.get("broadcast_address")
        for key in (v.get("id"), host and f"{host}:{v.get('tcp_port')}",
                    host and f"{host}:{v.get('http_port')}"):
            if key:
                out[str(key)] = v
    return out


def empty(mode: str) -> Snapshot:
    """The Snapshot before the first poll."""
    return Snapshot(mode=mode, taken_at=0.0, nodes={}, topics={}, lookupds=[], load=None,
                    load_note="not read yet", problems=["not read yet"])
