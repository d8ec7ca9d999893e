"""Cluster mode (`--etcd-endpoints`): the driver between this node and the cluster's
metadata in etcd (isr/README.md has the key tree).

It owns three things, all through isr, never blocking the event loop:
- the node's registration: `nodes/<node-id>` = NodeInfo under a kept lease (a clean stop
  revokes it, so the node leaves at once; a killed node's key expires after the TTL);
- a ClusterMirror of the whole cluster, which every decision reads (never etcd per
  request);
- the apply loop: after each view change, for every topic in etcd, the node serves
  `partition_num` and exactly the partitions whose state names it leader
  (NSQD.apply_assignment), with every channel of etcd on every led partition and no
  other (ephemeral channels stay local); a topic deleted in etcd is deleted here; a
  local topic etcd never showed (left from an earlier run) is kept on disk and leads
  nothing; a local topic of another incarnation than etcd's (`TopicView.incarnation`:
  deleted and made again under its name while this node was away) is deleted here before
  the new one is served, as Kafka does with a log whose topic id is not the topic's.

Writes go to etcd first and are served here once the mirror shows them: a classic PUB or
SUB of an unknown topic creates it in etcd (default partitions and replicas, placed over
the live nodes, this node leading at least one partition) and waits (5 s at most) until
the node serves it; a channel made by SUB or /channel/create is created in etcd before
it is made here, so the apply loop never takes it for a deleted one. When etcd is away
the node keeps serving its last view (at start: the assignments stored by the last run);
writes fail with ClusterUnavailable ("cluster metadata unavailable"), and the mirror
resyncs when etcd is back. A key that does not decode is reported (`bad_metadata` log
line, /stats `cluster.problems`), never a crash.
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.parse

import aiohttp
import structlog

from isr import keys
from isr.etcd import Etcd, EtcdError
from isr.leadership import LeaderKeys
from isr.metadata import ClusterView, Conflict, Metadata, TopicExists, TopicNotFound
from isr.mirror import ClusterMirror
from isr.placement import load_of, place
from isr.registry import Registration
from isr.state import BadValue, ChannelMeta, NodeInfo, TopicMeta, default_min_isr

from .assignment import Assignment
from .errors import ClusterUnavailable, TopicConflict
from .forward import Forwarder
from .loadreport import LoadReporter
from .replication import Replication

log = structlog.get_logger("nsqd.cluster")

WAIT_S = 5.0  # longest a request waits for etcd's answer to show in the mirror
RETRY_S = 1.0  # an apply pass that failed for a topic is tried again after this


def _rpc_address(rpc: str, broadcast_host: str, broadcast_port: int = 0) -> str:
    host, _, port = rpc.rpartition(":")
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = broadcast_host
    return f"{host}:{broadcast_port or port}"


class Cluster:
    """The cluster driver of one NSQD (see the module docstring). `start()` once the node
    listens (the node id needs its TCP port); `stop()` before the node drains."""

    def __init__(self, nsqd):
        self.nsqd = nsqd
        o = nsqd.options
        self.cluster_id = o.cluster_id
        ttl_s = max(1, o.etcd_lease_ttl_ms // 1000)
        # a call never outlasts half the lease: a lost lease is noticed while it can matter
        # and a watch silent for a TTL is opened again (an endpoint cut off from the rest
        # sends nothing and raises nothing: a watch kept on it would see no failover)
        self.etcd = Etcd(o.etcd_endpoints, timeout=max(1.0, min(3.0, ttl_s / 2)),
                         watch_idle_timeout=float(ttl_s))
        self.metadata = Metadata(self.etcd, o.cluster_id)
        self.mirror = ClusterMirror(self.etcd, o.cluster_id, on_change=self._on_change)
        self.replication = Replication(nsqd, self)
        # publishes to leaders elsewhere, answered within the node's commit timeout
        self.forwarder = Forwarder(self.replication, o.commit_timeout_ms / 1000)
        self.load = LoadReporter(self)  # load/<node-id>, read by the nsqlookupd master
        self.ttl = ttl_s
        self.node: NodeInfo | None = None
        self.registration: Registration | None = None
        self.leader_keys: LeaderKeys | None = None
        self.applied: set[str] = set()  # topics of etcd served as the last pass saw them
        self.applied_revision = 0
        self.errors: dict[str, str] = {}  # topic -> why the last pass could not apply it
        self._seen: set[str] = set()  # topics some view showed: gone later = deleted
        self._dirty = asyncio.Event()
        self._viewed = asyncio.Event()  # pulsed after each mirror rebuild
        self._passed = asyncio.Event()  # pulsed after each apply pass
        self.first_applied = asyncio.Event()  # set after the first pass (NSQD.serving)
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        # (topic, n) -> (the LeaderLog, the channels etcd had) at the pass that made that
        # LeaderLog (start_of)
        self._led_at: dict[tuple[str, int], tuple[object, frozenset]] = {}
        # channels made here without a state, whose start is not on the ISR yet (made_here)
        self._starting: dict[object, asyncio.Task] = {}
        self._http: aiohttp.ClientSession | None = None  # asks leaders (wait_made)

    @property
    def node_id(self) -> str:
        return self.node.id if self.node is not None else ""

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        o = self.nsqd.options
        host = o.broadcast_address
        tcp = f"{host}:{o.broadcast_tcp_port or self.nsqd.tcp_port}"
        self.node = NodeInfo(id=keys.check_node_id(tcp), tcp=tcp,
                             http=f"{host}:{o.broadcast_http_port or self.nsqd.http_port}",
                             rpc=_rpc_address(o.rpc_address, host, o.broadcast_rpc_port),
                             hostname=socket.gethostname()[:255], version=self.nsqd.version,
                             rack=o.rack)
        await self.replication.start()
        self.registration = Registration(self.etcd, keys.node(self.cluster_id, self.node.id),
                                         self.node.encode(), self.ttl).start()
        self.leader_keys = LeaderKeys(self.etcd, self.cluster_id, self.node.id,
                                      self.registration).start()
        self.mirror.start()
        self._tasks = [asyncio.create_task(self._apply_loop(), name="cluster apply"),
                       asyncio.create_task(self._report_start(), name="cluster start report"),
                       asyncio.create_task(self._watch_lease(), name="cluster lease watch"),
                       asyncio.create_task(self.load.run(), name="cluster load report")]
        log.info("cluster_started", node_id=self.node.id, cluster_id=self.cluster_id,
                 endpoints=o.etcd_endpoints, lease_ttl_s=self.ttl)

    async def stop(self) -> None:
        """Leave the cluster at once (the lease is revoked), then stop watching. A pass
        of the apply loop under way is let finish (WAIT_S at most), not cut in half."""
        self._stopping = True
        self._dirty.set()
        apply_task, *others = self._tasks or [None]
        for task in others:
            task.cancel()
        if apply_task is not None:
            try:
                async with asyncio.timeout(WAIT_S):
                    await asyncio.shield(apply_task)
            except TimeoutError:
                apply_task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        starting = list(self._starting.values())
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        await self.forwarder.close()
        await self.replication.stop()
        if self.leader_keys is not None:
            await self.leader_keys.close()
        if self.registration is not None:
            await self.registration.close()
        await self.mirror.close()
        await self.etcd.close()
        log.info("cluster_stopped", node_id=self.node_id)

    async def _report_start(self) -> None:
        """One clear line when etcd does not answer at start (isr keeps retrying)."""
        if not await self.registration.wait_registered(2.0):
            log.error("cluster_etcd_unreachable", endpoints=self.nsqd.options.etcd_endpoints,
                      error=self.registration.last_error,
                      serving="the assignments stored by the last run", retrying=True)
            await self.registration.registered.wait()
            log.info("cluster_etcd_reachable", node_id=self.node_id)

    @property
    def lease_held(self) -> bool:
        """The node's lease is current: what taking up the leadership of a partition needs
        (one led already goes on without it: see _apply)."""
        return bool(self.registration is not None and self.registration.lease_id)

    async def _watch_lease(self) -> None:
        """Apply again whenever the lease is lost or granted anew (leadership follows the
        leader keys, which go and come with it), or a LeaderLog gave up (Replication.gave_up)."""
        lease = 0
        while True:
            await asyncio.sleep(0.1)
            now = self.registration.lease_id
            if now != lease or self.replication.any_given_up():
                lease = now
                self._dirty.set()

    # ---- applying the view -----------------------------------------------

    def _on_change(self, view: ClusterView) -> None:
        self._dirty.set()
        self._viewed.set()
        self._viewed = asyncio.Event()

    async def _apply_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            if self._stopping:
                return
            view = self.mirror.view
            try:
                await self._apply(view)
            except Exception as e:  # a bug must not end the loop: said, retried
                log.exception("cluster_apply_failed")
                self.errors["*"] = f"{type(e).__name__}: {e}"
            self.first_applied.set()
            self._passed.set()
            self._passed = asyncio.Event()
            if self.errors:  # tried again after RETRY_S, or at once on a new view (a
                # leader key another node released: a leader move takes it without delay)
                try:
                    async with asyncio.timeout(RETRY_S):
                        await self._dirty.wait()
                except TimeoutError:
                    pass
                self._dirty.set()

    async def _apply(self, view: ClusterView) -> None:
        self.errors = {}
        applied = set()
        for name, tv in view.topics.items():
            try:
                await self._apply_topic(name, tv)
                applied.add(name)
            except Exception as e:
                log.error("cluster_topic_apply_failed", topic=name,
                          error=f"{type(e).__name__}: {e}")
                self.errors[name] = f"{type(e).__name__}: {e}"
        for name, topic in list(self.nsqd.topics.items()):
            if name in view.topics:
                continue
            if name in self._seen:  # deleted in etcd
                await self._delete_here(name)
                log.info("cluster_topic_deleted", topic=name)
            elif topic.assignment.leading:  # never in etcd: kept on disk, led by nobody
                await self.nsqd.apply_assignment(name, topic.assignment.partition_num, (),
                                                 incarnation=topic.assignment.incarnation)
                log.warning("cluster_topic_unknown", topic=name,
                            action="closed; its data stays on disk")
        self._seen = (self._seen & set(self.nsqd.topics)) | set(view.topics)
        self.applied = applied
        self.applied_revision = view.revision

    async def _delete_here(self, name: str) -> None:
        """Delete the topic on this node: its followed logs, leader keys, then its data."""
        self._led_at = {k: v for k, v in self._led_at.items() if k[0] != name}
        await self.replication.drop_topic(name)
        await self.leader_keys.release({p for p in self.leader_keys.wanted if p[0] == name})
        await self.nsqd.delete_topic(name)

    async def _apply_topic(self, name: str, tv) -> None:
        local = self.nsqd.topics.get(name)
        mine = local.assignment.incarnation if local is not None else 0
        if mine and tv.incarnation and mine != tv.incarnation:  # 0: not known, never deleted
            # The same name, another topic: the one held here was deleted in etcd while this
            # node was away (or between two views) and a new one made. Its data is never the
            # new one's log: its offsets and epochs would pass for the new leader's.
            await self._delete_here(name)
            log.warning("cluster_topic_replaced", topic=name, incarnation=mine,
                        by=tv.incarnation)
        named = {n for n, s in tv.partitions.items() if s.leader == self.node_id
                 and not self.replication.gave_up(name, n, s)}
        stale = {p for p in self.leader_keys.wanted if p[0] == name and p[1] not in named}
        if stale:
            await self.leader_keys.release(stale)
        # One replica: nobody else can take over (but a replica the master adds to move it,
        # which joins the ISR first and then leads in an epoch of its own, fencing this
        # one), so it serves at once, its key written in the background (and while etcd is
        # away, say, without it). More replicas: only with the key held.
        single = tv.meta.replicas == 1
        if single:
            self.leader_keys.want({(name, n) for n in named})
            held = set()
        else:
            held = await self.leader_keys.hold({(name, n) for n in named}) if named else set()
        # etcd away (the lease lost, no key can be held): a partition led here goes on while
        # its ISR acknowledges (a commit needs every ISR member; a leader elected meanwhile
        # is one of them and fences this one), none is taken up
        away = not self.lease_held
        leading, follow = self.replication.wanted(
            tv, lambda n: single or (name, n) in held
            or (away and self.replication.leading_now(name, n)))
        if not single and len(held) < len(named):  # another's key not expired yet: retried
            self.errors[name] = (f"leader keys of partitions "
                                 f"{sorted(n for n in named if (name, n) not in held)} "
                                 "not held yet")
        await self.replication.release(name, follow)  # a followed log closes before it is led
        want = Assignment(tv.meta.partitions, frozenset(leading), tv.meta.ordered,
                          incarnation=tv.incarnation)
        topic = self.nsqd.topics.get(name)
        if topic is None or topic.assignment != want:
            topic = await self.nsqd.apply_assignment(name, want.partition_num, want.leading,
                                                     want.ordered,
                                                     incarnation=want.incarnation)
        await self.nsqd.apply_topic_settings(
            topic, (tv.meta.sync_every, tv.meta.sync_timeout_ms), tv.meta.retention_ms or None,
            tv.meta.paused)
        await self.nsqd.tracer.follow(name, tv.meta.trace,
                                      {c for c, meta in tv.channels.items() if meta.trace})
        await self.replication.apply(name, tv, follow)
        self._note_led(name, topic, tv)
        # Channels: decided on the latest view, not the pass's (a SUB may have added one).
        for n in sorted(topic.writable):
            now = self.mirror.view.topics.get(name)
            if now is None:
                return
            p = topic.writable.get(n)
            for channel in sorted(set(now.channels) - set(p.channels if p else ())):
                await self.nsqd.get_channel(name, channel, n, register=False)
        for channel in sorted({c.name for c in topic.channels() if not c.ephemeral}):
            now = self.mirror.view.topics.get(name)
            if now is None or channel in now.channels:
                continue
            for n in sorted(topic.partitions):
                await self.nsqd.delete_channel(name, channel, n)
            log.info("cluster_channel_deleted", topic=name, channel=channel)

    # ---- where a channel without a state starts (nsqd/README.md "A new channel's start") --

    def _note_led(self, name: str, topic, tv) -> None:
        """Remember, for each partition led here, the channels etcd had at the pass that
        made its LeaderLog (the view that named this node its leader): one LeaderLog is
        one leadership, whatever epochs its ISR changes take; another is a new one,
        remembered anew. (Waiting for the leadership's own epoch would miss a channel
        etcd made meanwhile: no pass may run between that epoch and the next change.)"""
        for n in topic.writable:
            leader = self.replication.leaders.get((name, n))
            seen = self._led_at.get((name, n))
            if leader is not None and (seen is None or seen[0] is not leader):
                self._led_at[(name, n)] = (leader, frozenset(tv.channels))
        for key in [k for k in self._led_at if k[0] == name]:
            if self.replication.leaders.get(key) is not self._led_at[key][0]:
                del self._led_at[key]

    def start_of(self, topic: str, p, channel: str) -> tuple[int, int]:
        """Where a channel this partition has no state of starts (offset, count): at the
        committed end when etcd made the channel while this node led the partition in the
        leadership leading it now (it learns of the channel from etcd, or a SUB made it:
        the call that created it waits until this node made it, wait_made, so whatever is
        published after that call is at or after this end); at the partition's floor
        otherwise, never skipping (a new leader of a channel its predecessor never
        stored on the ISR, a view not applied yet, a restart). No clock is read: where
        a channel starts never depends on two machines' clocks agreeing."""
        seen = self._led_at.get((topic, p.number))
        if (seen is not None and seen[0] is self.replication.leaders.get((topic, p.number))
                and not seen[0].closed and channel not in seen[1]):
            q = p.queue
            return q.committed_end, q.committed_count
        return p.floor

    def channel_made(self, p, channel) -> None:
        """A channel just made here without a state: on a replicated partition its start
        is pushed to every ISR follower (Replication.push_channel) before it counts as
        made (made_here), so a failover keeps it; tried again until it is stored or the
        channel closes (its partition no longer led here)."""
        if channel.ephemeral or not p.queue.options.replicated:
            return
        old = self._starting.get(channel)
        if old is None or old.done():
            self._starting[channel] = asyncio.get_running_loop().create_task(
                self._push_start(p, channel), name=f"channel start {channel.topic_name}")

    async def _push_start(self, p, channel) -> None:
        where = {"topic": channel.topic_name, "partition": channel.partition,
                 "channel": channel.name}
        began = time.monotonic()
        failures = 0
        try:
            while not channel.closed and not self._stopping:
                delay = channel.delay
                if delay is not None and not delay.opened:  # replica_of needs it open
                    await asyncio.sleep(0.005)
                    continue
                try:
                    await self.replication.push_channel(channel)
                except Exception as e:  # not led yet (its LeaderLog starts), a closing log
                    failures += 1
                    if failures == 1 or failures % 100 == 0:
                        log.info("channel_start_not_stored_yet", **where,
                                 error=f"{type(e).__name__}: {e}")
                    await asyncio.sleep(min(0.5, 0.02 * failures))
                    continue
                log.info("channel_start_stored", **where, offset=channel.cursor.confirmed,
                         ms=round((time.monotonic() - began) * 1000, 1))
                return
        finally:
            if self._starting.get(channel) is asyncio.current_task():
                del self._starting[channel]

    def made_here(self, topic: str, channel: str) -> list[int]:
        """The partitions led here on which the channel is made: it exists, its metadata
        is on this node's disk (NSQD.saved) and a start made here is on the ISR
        (channel_made). GET /channel/made answers it."""
        t = self.nsqd.topics.get(topic)
        if t is None:
            return []
        out = []
        for n, p in sorted(t.writable.items()):
            c = p.channels.get(channel)
            if (c is not None and not c.closed and self.nsqd.saved(c)
                    and c not in self._starting):
                out.append(n)
        return out

    async def wait_made(self, topic: str, channel: str) -> None:
        """Return once the leader of every partition of the topic (as this node's view
        names it) has made the channel (made_here; other nodes over their HTTP API, GET
        /channel/made), WAIT_S at most; else ClusterUnavailable. A partition whose leader
        is not a live node is waited for: the node may still serve it. What is published
        after this returns reaches the channel (start_of)."""
        if channel.endswith("#ephemeral"):
            return
        deadline = time.monotonic() + WAIT_S
        made: set[int] = set()
        pause = 0.005
        while True:
            view = self.mirror.view
            tv = view.topics.get(topic) if view is not None else None
            if tv is None or channel not in tv.channels:
                raise ClusterUnavailable(f"channel {topic}/{channel} is not in the cluster "
                                         "metadata (deleted meanwhile)")
            asks: dict[str, set[int]] = {}
            for n, state in tv.partitions.items():
                if n not in made:
                    asks.setdefault(state.leader or "", set()).add(n)
            if not asks:
                return
            nodes = [node for node in asks if node in view.nodes]
            answers = await asyncio.gather(*(self._made_at(view.nodes[node], topic, channel,
                                                           deadline) for node in nodes))
            for node, got in zip(nodes, answers):
                made |= asks[node] & got
            if len(made) == len(tv.partitions):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = sorted(set(tv.partitions) - made)
                raise ClusterUnavailable(
                    f"channel {topic}/{channel} not made by the leaders of partitions "
                    f"{waiting} within {WAIT_S:g}s")
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 0.1)

    async def _made_at(self, node: NodeInfo, topic: str, channel: str,
                       deadline: float) -> set[int]:
        """The partitions `node` says it leads with the channel made (empty when it does
        not answer)."""
        if node.id == self.node_id:
            return set(self.made_here(topic, channel))
        if self._http is None:
            self._http = aiohttp.ClientSession()
        query = urllib.parse.urlencode({"topic": topic, "channel": channel})
        timeout = aiohttp.ClientTimeout(total=max(0.05, min(1.0, deadline - time.monotonic())))
        try:
            async with self._http.get(f"http://{node.http}/channel/made?{query}",
                                      timeout=timeout) as r:
                if r.status != 200:
                    return set()
                doc = await r.json(content_type=None)
            return {int(n) for n in doc.get("partitions", [])}
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, AttributeError):
            return set()

    async def _until(self, event_of, ready, what: str) -> None:
        """Wait (WAIT_S at most) until `ready()`, checking after each pulse of the event
        `event_of()` returns; ClusterUnavailable when it does not come."""
        deadline = time.monotonic() + WAIT_S
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterUnavailable(f"cluster metadata unavailable: {what} not seen "
                                         f"within {WAIT_S:g}s")
            try:
                async with asyncio.timeout(left):
                    await event_of().wait()
            except TimeoutError:
                pass

    def _check_connected(self) -> ClusterView:
        view = self.mirror.view
        if view is None or not self.mirror.connected:
            raise ClusterUnavailable("cluster metadata unavailable: etcd is not reachable")
        return view

    # ---- what requests ask -----------------------------------------------

    async def topic(self, name: str, create: bool):
        """A topic this node does not have yet (NSQD.get_topic): the one etcd has, or,
        with `create`, a new one made in etcd with the defaults; None when etcd has none
        and `create` is False (etcd read when this node's view lacks it). Returned once
        applied here, its partitions led here with
        their epochs taken (a publish right after is taken). Raises ClusterUnavailable."""
        if not self._knows(name) and self.mirror.connected:
            # just started: this node's view may lag etcd (a topic a lookupd already
            # serves is not in it yet); it has caught up once it shows our registration
            await self._until(lambda: self._passed, lambda: self._knows(name),
                              "this node's own registration")
        view = self.mirror.view
        if view is None or name not in view.topics:
            if create:
                await self._create(name, self.nsqd.options.default_partitions)
            elif not await self._in_etcd(name):
                return None
        await self._until(lambda: self._passed,
                          lambda: name in self.applied and name in self.nsqd.topics,
                          f"topic {name}")
        await self.replication.taken(name)
        return self.nsqd.topics[name]

    async def _in_etcd(self, name: str) -> bool:
        """Whether etcd has the topic now (one read): a topic made a moment ago elsewhere
        (the master nsqlookupd names this node its leader) that this node's view does not
        show yet. Raises ClusterUnavailable."""
        try:
            return await self.metadata.read_partition(name, 0) is not None
        except (EtcdError, BadValue) as e:
            raise ClusterUnavailable(f"cluster metadata unavailable: {e}") from None

    def _knows(self, name: str) -> bool:
        """The view has the topic, or is at least as new as this node's registration."""
        view = self.mirror.view
        return view is not None and (name in view.topics or self.node_id in view.nodes)

    async def create_topic(self, name: str, partition_num: int | None):
        """/topic/create in cluster mode: the topic in etcd (made when missing), then
        served here. Raises TopicConflict, ClusterUnavailable."""
        view = self.mirror.view
        tv = view.topics.get(name) if view is not None else None
        if tv is None:
            await self._create(name, partition_num or self.nsqd.options.default_partitions)
        elif partition_num is not None and tv.meta.partitions != partition_num:
            raise TopicConflict(f"topic {name} exists in etcd with partition_num "
                                  f"{tv.meta.partitions}, not {partition_num}")
        return await self.topic(name, create=False)

    async def _create(self, name: str, partition_num: int) -> None:
        """The topic in etcd, placed over the live nodes, this node leading at least one
        partition (so the classic client that asked is served here)."""
        view = self._check_connected()
        live = sorted(view.nodes)
        if self.node_id not in live:
            raise ClusterUnavailable("cluster metadata unavailable: this node is not "
                                     "registered in etcd yet")
        replicas = self.nsqd.options.default_replicas
        states = [s for t in view.topics.values() for s in t.partitions.values()]
        try:
            placement = place(live, partition_num, replicas, load_of(states), view.racks)
        except ValueError as e:
            raise ClusterUnavailable(f"topic {name} cannot be placed: {e}") from None
        if not any(r[0] == self.node_id for r in placement):
            mine = next((i for i, r in enumerate(placement) if self.node_id in r), None)
            if mine is None:
                placement[0][0] = self.node_id
            else:
                placement[mine].remove(self.node_id)
                placement[mine].insert(0, self.node_id)
        meta = TopicMeta(partitions=partition_num, replicas=replicas,
                         min_isr=default_min_isr(replicas))
        try:
            revision = await self.metadata.create_topic(name, meta, placement)
        except TopicExists:
            return  # made meanwhile by someone else: served as etcd has it
        except EtcdError as e:
            raise ClusterUnavailable(f"cluster metadata unavailable: {e}") from None
        log.info("cluster_topic_created", topic=name, partition_num=partition_num,
                 replicas=replicas, leaders=[r[0] for r in placement], revision=revision)

    async def ensure_channel(self, topic: str, channel: str) -> None:
        """Before a channel is made here (SUB, /channel/create): it exists in etcd and the
        mirror shows it. Ephemeral channels are this node's alone. Raises
        ClusterUnavailable."""
        if channel.endswith("#ephemeral"):
            return

        def shown() -> bool:
            tv = self.mirror.view.topics.get(topic) if self.mirror.view else None
            return tv is not None and channel in tv.channels

        if shown():
            return
        self._check_connected()
        try:
            await self.metadata.create_channel(topic, channel, ChannelMeta())
        except TopicNotFound:
            raise ClusterUnavailable(f"topic {topic} is not in the cluster metadata") from None
        except EtcdError as e:
            raise ClusterUnavailable(f"cluster metadata unavailable: {e}") from None
        log.info("cluster_channel_created", topic=topic, channel=channel)
        await self._until(lambda: self._viewed, shown, f"channel {topic}/{channel}")

    async def set_switch(self, topic: str, channel: str | None, switch: str, on: bool) -> bool:
        """A switch in etcd, which every leader follows: `trace` of a topic or channel
        (/message/trace/enable|disable), `paused` of a topic (/topic/pause|unpause).
        Returns once this node applied it (an apply pass of a view at least that recent),
        so no later pass of an older view takes it back. False: etcd has no such topic or
        channel. Raises ClusterUnavailable."""
        self._check_connected()
        try:
            revision = await self.metadata.set_switch(topic, channel, switch, on)
        except (EtcdError, Conflict, BadValue) as e:
            raise ClusterUnavailable(f"cluster metadata unavailable: {e}") from None
        if not revision:
            return False
        await self._until(lambda: self._passed, lambda: self.applied_revision >= revision,
                          f"the {switch} switch of {topic}")
        return True

    async def delete_topic(self, name: str) -> bool:
        """/topic/delete in cluster mode: delete it in etcd (every node deletes it)."""
        try:
            return await self.metadata.delete_topic(name)
        except EtcdError as e:
            raise ClusterUnavailable(f"cluster metadata unavailable: {e}") from None

    async def delete_channel(self, topic: str, channel: str) -> bool:
        """/channel/delete in cluster mode: delete it in etcd (every leader deletes it)."""
        if channel.endswith("#ephemeral"):
            return False
        try:
            return await self.metadata.delete_channel(topic, channel)
        except EtcdError as e:
            raise ClusterUnavailable(f"cluster metadata unavailable: {e}") from None

    # ---- what /stats shows -----------------------------------------------

    def state(self) -> dict:
        view = self.mirror.view
        led = {name: sorted(t.assignment.leading) for name, t in self.nsqd.topics.items()
               if t.assignment.leading}
        problems = list(view.problems) if view is not None else []
        problems += [f"topic {t}: {e}" for t, e in sorted(self.errors.items())]
        reg = self.registration
        return {
            "node_id": self.node_id,
            "cluster_id": self.cluster_id,
            "etcd_endpoints": self.nsqd.options.etcd_endpoints,
            "etcd_connected": self.mirror.connected,
            "lease_ok": bool(reg and reg.registered.is_set()),
            "lease_ttl_s": self.ttl,
            "etcd_error": reg.last_error if reg else None,
            "revision": self.applied_revision,
            "live_nodes": sorted(view.nodes) if view is not None else [],
            "topics_led": len(led),
            "partitions_led": sum(len(v) for v in led.values()),
            "led": led,
            "problems": problems,
            "replication": self.replication.state(),
            **self.forwarder.stats,  # forwarded, forward_failed: publish requests (forward.py)
        }
