"""Replication on this node (cluster mode): the host that isr's replication runs on.

For every partition that the cluster's view gives this node (every one is a replicated
log, a topic of one replica too: its ISR is its leader alone), one of:
- led here (the state names this node leader and it holds the partition's leader key, or
  the topic has one replica):
  the open Partition's log gets a `LeaderLog`, whose writer takes the partition's
  publishes (the Partition's `writer`, while it says `writable`) and pushes every batch
  to the in-sync followers;
- followed here (this node is in the ISR or the catch-up list, not leader): a
  `FollowerLog` over a DiskQueue of its own in the partition's folder; no client sees it.
The RPC server (`--rpc-address`) answers the other nodes' pushes, fetches and joins.

Invariants:
- a partition's folder is open by one DiskQueue at a time: a follower's queue is closed
  before the partition is led (`release`), and a led partition is closed by
  NSQD.apply_assignment before it is followed (`apply`);
- the ISR is changed only through `change_isr` (CAS on the state's revision);
- channel states a leader sends are stored like a checkpoint of this node's own, so a
  follower that becomes leader opens its channels where the old leader's last send left
  them (at-least-once: what moved on after that send is delivered again);
- a led channel's states go out in the order they were taken, the latest of each channel
  (one task makes them: handover.replica_of reads the delay store off the event loop).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os

import structlog

from diskqueue.queue import DiskQueue
from isr.follower import FollowerLog
from isr.leader import LeaderLog, NotWritable
from isr.metadata import TopicView
from isr.peer import Peers
from isr.rpc import RpcServer
from isr.state import PartitionState

from . import forward
from .handover import replica_of
from .metastore import channel_key
from .replica import checkpoint_of
from .topic import NotLed

log = structlog.get_logger("nsqd.replication")


def state_to_wire(state: dict) -> dict:
    """A channel checkpoint as JSON: bytes values (packed ranges, attempts) in base64."""
    return {k: {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v
            for k, v in state.items()}


def state_from_wire(state: dict) -> dict:
    """The inverse of state_to_wire (raises ValueError, TypeError on a bad value)."""
    if not isinstance(state, dict):
        raise TypeError("a channel state is a JSON object")
    return {k: base64.b64decode(v["b64"], validate=True) if isinstance(v, dict) else v
            for k, v in state.items()}


class Replication:
    """The replication host of one NSQD in cluster mode (see the module docstring)."""

    def __init__(self, nsqd, cluster):
        self.nsqd = nsqd
        self.cluster = cluster
        self.leaders: dict[tuple[str, int], LeaderLog] = {}
        self.followers: dict[tuple[str, int], FollowerLog] = {}
        self.peers = Peers(self)
        self.server = RpcServer(self, nsqd.options.rpc_address)
        # partitions whose leadership this node gave up at an epoch (its LeaderLog closed
        # for good while etcd still names it): not taken again before a newer epoch
        self.refused: dict[tuple[str, int], int] = {}
        # the confirmed offset of each channel of each followed partition, as its leader
        # last sent it (never past its first held message, dead letter or undecided half
        # message): what retention may drop here
        self._confirmed: dict[tuple[str, int], dict[str, int]] = {}
        self._outbox: dict = {}  # channel -> its latest checkpoint not yet sent (send_states)
        self._sender: asyncio.Task | None = None

    # ---- the host interface isr calls ----------------------------------------------

    @property
    def cluster_id(self) -> str:
        return self.cluster.cluster_id

    @property
    def node_id(self) -> str:
        return self.cluster.node_id

    def leader_log(self, topic: str, partition: int) -> LeaderLog | None:
        return self.leaders.get((topic, partition))

    def follower_log(self, topic: str, partition: int) -> FollowerLog | None:
        """The follower of a partition once it is open: a push that comes while it opens
        waits for it (isr/rpc.py `_arrival`) instead of reaching a follower with no core."""
        follower = self.followers.get((topic, partition))
        return follower if follower is not None and follower.opened else None

    def publish_forwarded(self, frame, answer) -> None:
        """A publish another node forwarded here (nsqd/forward.py); `answer` is called once."""
        forward.serve(self.nsqd, frame.header, frame.payload, answer)

    def peer_address(self, node_id: str) -> str | None:
        view = self.cluster.mirror.view
        node = view.nodes.get(node_id) if view is not None else None
        return node.rpc if node is not None else None

    async def change_isr(self, topic: str, partition: int, expected: PartitionState,
                         new: PartitionState) -> PartitionState:
        """CAS of the partition's state (raises isr.metadata.Conflict when it moved on)."""
        written = await self.cluster.metadata.update_partition(
            topic, partition, new.evolve(revision=expected.revision))
        log.info("isr_changed", topic=topic, partition=partition, leader=written.leader,
                 isr=list(written.isr), catchup=list(written.catchup), epoch=written.epoch)
        return written

    async def read_state(self, topic: str, partition: int) -> PartitionState | None:
        """The partition's state as etcd holds it now (a read back after an unknown CAS)."""
        return await self.cluster.metadata.read_partition(topic, partition)

    def channels_received(self, topic: str, partition: int, channels: dict) -> None:
        """The leader's channel states of a partition followed here: stored as this node's
        own checkpoint of them (written with the next flush)."""
        if (topic, partition) not in self.followers:
            return
        meta = self.nsqd.meta
        confirmed = self._confirmed.setdefault((topic, partition), {})
        for name, state in channels.items():
            try:
                state = state_from_wire(state)
                checkpoint_of(state)  # raises ValueError on a damaged `held` or `held_cursor`
                meta.put(channel_key(topic, partition, name), state)
                # its dead letters and the undecided half messages are kept too
                # (nsqd/deadletters.py, nsqd/halves.py)
                confirmed[name] = min(int(state["confirmed"]),
                                      int(state.get("dead_from", state["confirmed"])),
                                      int(state.get("halves_from", state["confirmed"])))
            except (TypeError, ValueError, AttributeError, KeyError) as e:
                log.warning("channel_state_refused", topic=topic, partition=partition,
                            channel=name, error=str(e))

    def channel_stored(self, channel, state: dict) -> None:
        """A checkpoint of a channel led here: its followers get it (batched, async), with
        the first messages its delay store holds listed (handover.replica_of). A leader
        with no follower (a topic of one replica) sends nothing: a joiner gets every
        channel's state before it enters the ISR (LeaderLog._send_every_channel)."""
        leader = self.leaders.get((channel.topic_name, channel.partition))
        if leader is not None and leader.followed:
            self._outbox[channel] = state
            if self._sender is None or self._sender.done():
                self._sender = asyncio.get_running_loop().create_task(self._send_states())

    async def _send_states(self) -> None:
        """Send what is in the outbox, one channel at a time, so each channel's states go
        out in the order they were taken (LeaderLog.send_channels keeps the latest)."""
        while self._outbox:
            channel = next(iter(self._outbox))
            state = self._outbox.pop(channel)
            try:
                replica = await replica_of(channel, state)
            except Exception:  # this channel's state waits for its next checkpoint
                log.exception("channel_state_failed", topic=channel.topic_name,
                              partition=channel.partition, channel=channel.name)
                continue
            leader = self.leaders.get((channel.topic_name, channel.partition))
            if leader is not None and replica is not None and channel not in self._outbox:
                leader.send_channels({channel.name: state_to_wire(replica)})

    async def channel_states(self, topic: str, partition: int) -> dict:
        """Every channel's state of a partition led here, as followers store it (a joiner
        gets them all before it enters the ISR: isr.leader)."""
        t = self.nsqd.topics.get(topic)
        p = t.partitions.get(partition) if t is not None else None
        out = {}
        for channel in list(p.channels.values()) if p is not None else ():
            if channel.ephemeral:
                continue
            replica = await replica_of(channel, channel.checkpoint())
            if replica is not None:
                out[channel.name] = state_to_wire(replica)
        return out

    async def push_channel(self, channel) -> None:
        """A channel's checkpoint, stored here, to every ISR follower now (an ordered
        channel's FIN, an admin change of the channel); returns once they all stored it
        (LeaderLog.push_channels)."""
        leader = self.leaders.get((channel.topic_name, channel.partition))
        if leader is None:
            raise NotWritable(f"partition {channel.partition} is not led here")
        state = channel.checkpoint()
        self.nsqd.meta.put(channel_key(channel.topic_name, channel.partition, channel.name), state)
        replica = await replica_of(channel, state)
        if replica is not None:  # None only before the channel delivered anything
            await leader.push_channels({channel.name: state_to_wire(replica)})

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        """Stop replicating: leaders first (their partitions close with the node), then
        followers with their queues, then the server."""
        if self._sender is not None:
            self._sender.cancel()
        for key in list(self.leaders):
            await self._stop_leader(key)
        for key in list(self.followers):
            await self._stop_follower(key)
        await self.server.stop()
        await self.peers.close()

    # ---- following the view ------------------------------------------------------------

    def wanted(self, tv: TopicView, held_keys) -> tuple[set[int], dict[int, PartitionState]]:
        """(partitions to lead, {partition: state} to follow) of a topic for this node;
        `held_keys(n)` says whether the partition's leader key is ours."""
        me = self.node_id
        lead, follow = set(), {}
        for n, s in tv.partitions.items():
            if s.leader == me and held_keys(n) and not self.gave_up(tv.name, n, s):
                lead.add(n)
            elif s.leader != me and (me in s.isr or me in s.catchup):
                follow[n] = s
        return lead, follow

    def gave_up(self, topic: str, n: int, state: PartitionState) -> bool:
        """Whether this node gave up leading the partition at `state`'s epoch: its
        LeaderLog closed for good (a newer epoch seen) or its log failed, while etcd still
        names it. It then holds no leader key, and the master elects another ISR
        member once the key has been missing for the lease TTL."""
        leader = self.leaders.get((topic, n))
        if leader is not None and _given_up(leader, self.node_id):
            self.refused[(topic, n)] = state.epoch
            log.warning("leadership_given_up", topic=topic, partition=n, epoch=state.epoch,
                        reason=leader.reason)
        return self.refused.get((topic, n), -1) >= state.epoch

    def leading_now(self, topic: str, n: int) -> bool:
        """Whether the partition is led here in an epoch of its own, not stopped."""
        leader = self.leaders.get((topic, n))
        return leader is not None and not leader.closed and leader.epoch > 0

    async def taken(self, name: str) -> None:
        """Wait until each partition of `name` led here has its epoch (LeaderLog.taken,
        bounded): a publish that made the topic here finds it writable. One that stopped
        or took too long is left to say why when published to."""
        for key, leader in list(self.leaders.items()):
            if key[0] == name:
                try:
                    await leader.taken()
                except TimeoutError:
                    pass

    def any_given_up(self) -> bool:
        """A LeaderLog closed for good while etcd still names this node (see gave_up)."""
        return any(_given_up(lg, self.node_id) for lg in self.leaders.values())

    async def release(self, name: str, keep: dict[int, PartitionState]) -> None:
        """Before NSQD.apply_assignment: close the followers of `name` not in `keep`."""
        for key in [k for k in self.followers if k[0] == name and k[1] not in keep]:
            await self._stop_follower(key)

    async def apply(self, name: str, tv: TopicView, follow: dict[int, PartitionState]) -> None:
        """After NSQD.apply_assignment: a LeaderLog on every led, open partition of a
        replicated topic; a FollowerLog on every followed one; nothing else."""
        topic = self.nsqd.topics.get(name)
        led = {} if topic is None else {n: p for n, p in topic.writable.items()
                                        if p.queue.options.replicated}
        for key in [k for k in self.leaders if k[0] == name]:
            p = led.get(key[1])
            if p is None or p.queue is not self.leaders[key].q:
                await self._stop_leader(key)
        for n, p in led.items():
            state = tv.partitions[n]
            current = self.leaders.get((name, n))
            if current is not None:
                current.update_state(state)
                continue
            leader = LeaderLog(self, self.peers, name, n, p.queue, state,
                               min_isr=tv.meta.min_isr,
                               repl_timeout=self.nsqd.options.repl_timeout_ms / 1000)
            self.leaders[(name, n)] = leader
            await leader.start()
            p.writer = _Led(leader, self)
            log.info("leading", topic=name, partition=n, epoch=state.epoch,
                     isr=list(state.isr), catchup=list(state.catchup))
        for n, state in follow.items():
            current = self.followers.get((name, n))
            if current is not None:
                current.follow(state)
                continue
            if topic is None:
                continue
            queue = await self._open_follower_queue(topic, n)
            if queue is None:
                continue
            follower = FollowerLog(self, self.peers, name, n, queue)
            self.followers[(name, n)] = follower
            await follower.open()
            follower.follow(state)
            log.info("following", topic=name, partition=n, leader=state.leader,
                     epoch=state.epoch, in_isr=self.node_id in state.isr)

    def followed_floors(self):
        """(topic, partition, queue, floor) of each partition followed here: `floor` is the
        lowest offset a channel of the topic (in the cluster's view) has not confirmed, as the
        leader last said (a replica state's `confirmed` stops at its first held message: a
        new leader reads that record); 0, keep everything, until the leader has said it."""
        topics = self.cluster.mirror.view.topics
        for (name, n), follower in list(self.followers.items()):
            tv = topics.get(name)
            confirmed = self._confirmed.get((name, n), {})
            channels = tv.channels if tv is not None else ()
            floor = min((confirmed.get(c, 0) for c in channels), default=0) if channels else 0
            yield name, n, follower.q, floor

    async def drop_topic(self, name: str) -> None:
        """A topic deleted (or no longer in the view): stop everything of it, and forget the
        epochs given up (a topic made again under the name starts again at epoch 1)."""
        self.refused = {k: e for k, e in self.refused.items() if k[0] != name}
        for key in [k for k in self.leaders if k[0] == name]:
            await self._stop_leader(key)
        for key in [k for k in self.followers if k[0] == name]:
            await self._stop_follower(key)

    async def _open_follower_queue(self, topic, n: int) -> DiskQueue | None:
        path = os.path.join(topic.path, str(n))
        opts = dataclasses.replace(topic.queue_options, partition=n, replicated=True)
        try:
            return await DiskQueue.open(path, opts)
        except Exception as e:  # stays inside this partition: not followed, said why
            log.error("follower_open_failed", topic=topic.name, partition=n,
                      error=f"{type(e).__name__}: {e}")
            return None

    async def _stop_leader(self, key) -> None:
        leader = self.leaders.pop(key)
        await leader.close("no longer led here")
        topic = self.nsqd.topics.get(key[0])
        p = topic.partitions.get(key[1]) if topic is not None else None
        if p is not None and getattr(p.writer, "leader", None) is leader:
            p.writer = NotLed("it is changing leader")

    async def _stop_follower(self, key) -> None:
        follower = self.followers.pop(key)
        self._confirmed.pop(key, None)
        try:
            await follower.close()
        finally:
            await follower.q.close()
        log.info("not_following", topic=key[0], partition=key[1])

    # ---- what /stats shows -------------------------------------------------------------

    def state(self) -> dict:
        return {"rpc_port": self.server.port,
                "leading": {f"{t}/{n}": {"epoch": lg.state.epoch, "isr": list(lg.state.isr),
                                         "writable": lg.writable, "reason": lg.reason,
                                         **lg.stats}
                            for (t, n), lg in sorted(self.leaders.items())},
                "following": {f"{t}/{n}": {"epoch": f.epoch, **f.stats}
                              for (t, n), f in sorted(self.followers.items())}}


def _given_up(leader: LeaderLog, me: str) -> bool:
    """Closed for good, or its log failed (a write or sync that failed after the batch was
    pushed: that place must never take another batch), while etcd still names this node."""
    return (leader.closed or leader.q.failed is not None) and leader.state.leader == me


class _Led:
    """The writer of a partition led here (nsqd/topic.py Partition.writer): publishes go to
    the LeaderLog's writer, writable while the LeaderLog says so; channel states go to the
    ISR. The node's etcd lease is not asked: while etcd is away a leader whose whole ISR
    acknowledges goes on committing (no leader can be elected meanwhile, and one elected
    from its ISR after fences it: issue 28 item 10)."""

    __slots__ = ("append", "leader", "push_channel", "save_channel")

    def __init__(self, leader: LeaderLog, replication: Replication):
        self.leader = leader
        self.append = leader.writer.append
        self.save_channel = replication.channel_stored
        self.push_channel = replication.push_channel

    @property
    def writable(self) -> bool:
        return self.leader.writable and self.leader.q.failed is None

    @property
    def starting(self) -> bool:
        """Taking this leadership's epoch (publishes may wait for it: NSQD.until_led)."""
        return not self.leader.closed and not self.leader.epoch

    @property
    def reason(self) -> str:
        if self.leader.q.failed is not None:
            return f"its log failed: {self.leader.q.failed}"
        return self.leader.reason
