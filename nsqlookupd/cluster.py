"""Cluster mode: this nsqlookupd's place in an etcd-held cluster (isr/ does the etcd work).

`Cluster` registers the lookupd's LookupdInfo under a lease, campaigns for the master
key, and keeps a ClusterMirror whose every new view becomes a new `ClusterDirectory`:
every read of the HTTP API is served from it, never from etcd. Writes (topic and channel
create and delete) are the master's alone and go to etcd as one transaction each; a
write returns once this lookupd's own mirror shows it (bounded), so a read that follows
on the same lookupd sees it. The master also gives a partition whose leader is gone a
new leader (failover.py), on every new view and every second.

Invariants:
- a non-master never writes metadata: it answers 503 NOT_MASTER with the master's HTTP
  address (null while there is none);
- a new topic's placement counts the partitions every live node already holds;
- etcd unreachable: reads go on from the last view (`info()` says so), writes get 503
  CLUSTER_METADATA_UNAVAILABLE; the mirror, the registration and the election resume
  on their own when etcd is back.
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.parse

import aiohttp
import structlog

from isr import keys
from isr.election import Election
from isr.etcd import Etcd, EtcdError
from isr.metadata import ClusterView, Metadata, TopicExists, TopicNotFound
from isr.mirror import ClusterMirror
from isr.placement import load_of, place
from isr.registry import Registration
from isr.state import ChannelMeta, LookupdInfo, TopicMeta

from .directory import ClusterDirectory
from .balancer import Balancer, format_window, parse_window
from .failover import Failover
from .http import HTTPError
from .loads import LoadReports, cluster_stats
from .moves import LeaderMover

log = structlog.get_logger("nsqlookupd.cluster")

SEEN_TIMEOUT = 3.0  # seconds a write waits for the mirror to show it
MADE_TIMEOUT = 5.0  # seconds a channel create waits for every partition's leader to make it
RECONNECT_WAIT = 2.0  # seconds a write waits for the etcd watch to be up again


class Cluster:
    """The driver: registration, election, mirror; the master's writes."""

    def __init__(self, options, version: str):
        self.cluster_id = keys.check_cluster(options.cluster_id)
        self.ttl = int(options.etcd_lease_ttl)
        self.version = version
        # a watch silent for a TTL is opened again: an etcd endpoint cut off from the rest
        # sends nothing and raises nothing, and a master watching it would fail nothing over
        self.etcd = Etcd(options.etcd_endpoints, timeout=max(1.0, min(3.0, self.ttl / 2)),
                         watch_idle_timeout=float(self.ttl))
        self.metadata = Metadata(self.etcd, self.cluster_id)
        self.directory = ClusterDirectory(None)
        self.info: LookupdInfo | None = None
        self.registration: Registration | None = None
        self.election: Election | None = None
        self.mirror: ClusterMirror | None = None
        self.failover = Failover(self.metadata, self.ttl, self._current_view,
                                 lambda: self.is_master)
        self.loads = LoadReports(self.etcd, self.cluster_id)
        self.viewed = asyncio.Event()  # pulsed on every new view
        self.mover = LeaderMover(self.metadata, self.master_view_now, lambda: self.viewed)
        self.balancer = Balancer(self, parse_window(options.balance_window),
                                 options.balance_tolerance, options.balance_interval,
                                 leaders=options.leader_balance == "on",
                                 settle=options.leader_balance_settle)

    async def start(self, broadcast_address: str, tcp_port: int, http_port: int) -> None:
        lookupd_id = keys.check_node_id(f"{broadcast_address}:{tcp_port}")
        self.info = LookupdInfo(id=lookupd_id, tcp=lookupd_id,
                                http=f"{broadcast_address}:{http_port}",
                                hostname=socket.gethostname()[:255], version=self.version)
        self.mirror = ClusterMirror(self.etcd, self.cluster_id, on_change=self._on_view).start()
        self.registration = Registration(self.etcd, keys.lookupd(self.cluster_id, lookupd_id),
                                         self.info.encode(), self.ttl).start()
        self.election = Election(self.etcd, keys.lookupd_master(self.cluster_id), lookupd_id,
                                 self.ttl, on_change=lambda *_: self.failover.poke()).start()
        self.failover.start()
        self.loads.start()
        self.balancer.start()
        log.info("cluster_mode", cluster=self.cluster_id, id=lookupd_id, ttl=self.ttl,
                 etcd=self.etcd.endpoint)

    async def close(self) -> None:
        """Resign (the master key goes at once), unregister, stop watching."""
        for part in (self.balancer, self.loads, self.failover, self.election, self.registration,
                     self.mirror):
            if part is not None:
                await part.close()
        await self.etcd.close()

    def _on_view(self, view: ClusterView) -> None:
        self.directory = ClusterDirectory(view)
        self.failover.poke()
        self.viewed.set()
        self.viewed = asyncio.Event()

    def _current_view(self) -> ClusterView | None:
        """The view while it is current (the watch is up), else None."""
        return self.directory.view if self.mirror is not None and self.mirror.connected else None

    # ---- reads ---------------------------------------------------------------------

    @property
    def is_master(self) -> bool:
        return self.election is not None and self.election.is_master

    def master_http_address(self) -> str | None:
        master = self.election.master_id if self.election is not None else None
        view = self.directory.view
        if master is None or view is None or master not in view.lookupds:
            return None
        return view.lookupds[master].http

    def status(self) -> dict:
        """What /info shows of the cluster: roles, freshness of the view, what is wrong."""
        view = self.directory.view
        connected = self.mirror is not None and self.mirror.connected
        if view is None:
            freshness = "not read yet (etcd unreachable)"
        elif connected:
            freshness = "current"
        else:
            freshness = "last known view: etcd unreachable, serving it until etcd is back"
        return {"cluster_id": self.cluster_id, "id": self.info.id if self.info else None,
                "is_master": self.is_master,
                "master": self.election.master_id if self.election else None,
                "master_http_address": self.master_http_address(),
                "registered": bool(self.registration and self.registration.registered.is_set()),
                "etcd_connected": connected, "view": freshness,
                "view_revision": view.revision if view else 0,
                "nodes": len(view.nodes) if view else 0,
                "topics": len(view.topics) if view else 0,
                "leaderless": self.directory.leaderless(),
                "elections": self.failover.elections,
                "problems": self.directory.problems()}

    def listlookup(self) -> dict:
        view = self.directory.view
        lookupds = view.lookupds if view is not None else {}

        def entry(info: LookupdInfo) -> dict:
            host, _, tcp_port = info.tcp.rpartition(":")
            return {"ID": info.id, "NodeIP": host, "TcpPort": tcp_port,
                    "HttpPort": info.http.rpartition(":")[2]}

        master = self.election.master_id if self.election else None
        return {"lookupdnodes": [entry(lookupds[i]) for i in sorted(lookupds)],
                "lookupdleader": entry(lookupds[master]) if master in lookupds else None}

    def stats(self, topn: int) -> dict:
        """`/cluster/stats` (loads.cluster_stats): from this lookupd's view and the load
        reports it last read, with each node's drain state and the balancer's. `stable`: no
        move under way, every partition led by a live node, its ISR full, nothing
        catching up, and no balancer move left to make (partitions held and led per node within
        the tolerance, or nothing movable)."""
        view = self.directory.view
        if view is None:
            raise HTTPError(503, "CLUSTER_VIEW_NOT_READY", error="etcd not read yet")
        b = self.balancer
        stable = (not self.mover.busy and not view.leaderless()
                  and b.plan(view, True, settle=False) is None
                  and all(len(s.isr) >= t.meta.replicas and not s.catchup
                          for t in view.topics.values() for s in t.partitions.values()))
        out = cluster_stats(view, self.loads.reports, topn, stable, int(time.time() * 1000))
        for node in out["node_stat_list"]:
            drain = b.drains.get(node["id"], {})
            node["draining"] = drain.get("state") == "draining"
            node["removable"] = drain.get("state") == "removable"
        out["balance"] = {"window": format_window(b.window), "open": b.open_now(),
                          "leaders": b.leaders, "leader_settle_s": b.settle,
                          "tolerance": b.tolerance, "moves": b.moves,
                          "last_error": b.last_error, "moving": self.mover.busy,
                          "last_move": self.mover.last,
                          "drains": {n: dict(d) for n, d in sorted(b.drains.items())}}
        return out

    # ---- writes (master only) --------------------------------------------------------

    def master_view_now(self) -> ClusterView:
        """The current view, on the master only; HTTPError at once when there is none."""
        if not self.is_master:
            raise HTTPError(503, "NOT_MASTER", master_http_address=self.master_http_address())
        view = self.directory.view
        if view is None or not self.mirror.connected:
            raise HTTPError(503, "CLUSTER_METADATA_UNAVAILABLE",
                            error="etcd unreachable: no current view of the cluster")
        return view

    async def master_view(self) -> ClusterView:
        """master_view_now, for a write: the etcd watch reopens itself now and then (every
        idle timeout), so a write waits up to RECONNECT_WAIT for it before it answers 503
        CLUSTER_METADATA_UNAVAILABLE."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RECONNECT_WAIT
        while True:
            try:
                return self.master_view_now()
            except HTTPError as e:
                if e.code != "CLUSTER_METADATA_UNAVAILABLE" or loop.time() >= deadline:
                    raise
            await asyncio.sleep(0.02)

    def _placeable(self, view: ClusterView) -> list[str]:
        """The live nodes a new topic goes to: those not draining (all, if all are)."""
        return sorted(set(view.nodes) - self.balancer.draining) or sorted(view.nodes)

    async def create_topic(self, topic: str, meta: TopicMeta) -> bool:
        """Place and write a new topic: False if it exists already with these settings."""
        view = await self.master_view()
        existing = view.topics.get(topic)
        if existing is not None:
            return self._same_topic(topic, existing.meta, meta)
        live = self._placeable(view)
        if meta.replicas > len(live):  # the mirror may lag etcd (a watch replaying): ask etcd
            try:
                view = await self.metadata.read()
            except EtcdError as e:
                raise _unavailable(e) from None
            live = self._placeable(view)
            if meta.replicas > len(live):
                raise HTTPError(400, "INVALID_ARG_REPLICATOR",
                                detail=f"replicas {meta.replicas} > live nodes {len(live)}")
        load = load_of(s for t in view.topics.values() for s in t.partitions.values())
        placement = place(live, meta.partitions, meta.replicas, load, view.racks)
        try:
            await self.metadata.create_topic(topic, meta, placement)
        except TopicExists:
            await self._until_seen(lambda v: topic in v.topics)
            return self._same_topic(topic, self.directory.view.topics[topic].meta, meta)
        except EtcdError as e:
            raise _unavailable(e) from None
        log.info("topic_created", topic=topic, partitions=meta.partitions,
                 replicas=meta.replicas, leaders=[r[0] for r in placement])
        await self._until_seen(lambda v: topic in v.topics)
        return True

    @staticmethod
    def _same_topic(topic: str, existing: TopicMeta, asked: TopicMeta) -> bool:
        if existing != asked:
            raise HTTPError(409, "TOPIC_EXISTS",
                            detail=f"{topic} exists with partition_num {existing.partitions}, "
                                   f"replicator {existing.replicas}")
        return False

    async def delete_topic(self, topic: str) -> bool:
        await self.master_view()
        try:
            deleted = await self.metadata.delete_topic(topic)
        except EtcdError as e:
            raise _unavailable(e) from None
        log.info("topic_deleted", topic=topic, existed=deleted)
        await self._until_seen(lambda v: topic not in v.topics)
        return deleted

    async def create_channel(self, topic: str, channel: str) -> bool:
        await self.master_view()
        meta = ChannelMeta()
        try:
            created = await self.metadata.create_channel(topic, channel, meta)
        except TopicNotFound:
            raise HTTPError(404, "TOPIC_NOT_FOUND") from None
        except EtcdError as e:
            raise _unavailable(e) from None
        log.info("channel_created", topic=topic, channel=channel, new=created)
        await self._until_seen(lambda v: topic not in v.topics
                               or channel in v.topics[topic].channels)
        await self._until_made(topic, channel)
        return created

    async def _until_made(self, topic: str, channel: str) -> None:
        """Wait until the leader of every partition (as this lookupd's view names it) says
        it made the channel (nsqd's GET /channel/made: the channel exists there and its
        start is on the ISR), as nsqd's own creates do (nsqd/cluster.py wait_made): what
        is published after the answer reaches the channel. 503 CHANNEL_NOT_MADE with the
        partitions still waited for after MADE_TIMEOUT."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MADE_TIMEOUT
        made: set[int] = set()
        query = urllib.parse.urlencode({"topic": topic, "channel": channel})
        pause = 0.005
        async with aiohttp.ClientSession() as session:

            async def ask(http: str) -> set[int]:
                timeout = aiohttp.ClientTimeout(total=max(0.05, min(1.0, deadline - loop.time())))
                try:
                    async with session.get(f"http://{http}/channel/made?{query}",
                                           timeout=timeout) as r:
                        doc = await r.json(content_type=None) if r.status == 200 else {}
                    return {int(n) for n in doc.get("partitions", [])}
                except (aiohttp.ClientError, TimeoutError, ValueError, TypeError,
                        AttributeError):
                    return set()

            while True:
                view = self.directory.view
                tv = view.topics.get(topic) if view is not None else None
                if tv is None or channel not in tv.channels:
                    return  # deleted meanwhile: nothing to wait for
                asks: dict[str, set[int]] = {}
                for n, state in tv.partitions.items():
                    if n not in made:
                        asks.setdefault(state.leader or "", set()).add(n)
                nodes = [node for node in asks if node in view.nodes]
                answers = await asyncio.gather(*(ask(view.nodes[node].http) for node in nodes))
                for node, got in zip(nodes, answers):
                    made |= asks[node] & got
                if len(made) == len(tv.partitions):
                    return
                if loop.time() >= deadline:
                    raise HTTPError(503, "CHANNEL_NOT_MADE",
                                    partitions=sorted(set(tv.partitions) - made))
                await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
                pause = min(pause * 2, 0.1)

    async def delete_channel(self, topic: str, channel: str) -> bool:
        await self.master_view()
        try:
            deleted = await self.metadata.delete_channel(topic, channel)
        except EtcdError as e:
            raise _unavailable(e) from None
        if deleted:
            log.info("channel_deleted", topic=topic, channel=channel)
            await self._until_seen(lambda v: topic not in v.topics
                                   or channel not in v.topics[topic].channels)
        return deleted

    async def _until_seen(self, seen) -> None:
        """Wait (bounded) until this lookupd's view satisfies `seen`."""
        deadline = asyncio.get_running_loop().time() + SEEN_TIMEOUT
        while asyncio.get_running_loop().time() < deadline:
            view = self.directory.view
            if view is not None and seen(view):
                return
            await asyncio.sleep(0.01)
        log.warning("write_not_seen_yet", timeout_s=SEEN_TIMEOUT)


def _unavailable(e: EtcdError) -> HTTPError:
    return HTTPError(503, "CLUSTER_METADATA_UNAVAILABLE", error=f"etcd: {e}")
