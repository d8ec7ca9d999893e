"""Leader transfer within the ISR: the master moves one partition's leadership to another
in-sync replica, with no data copy.

The steps, and why each is safe:
1. `check_leader_move` (pure) refuses what must not move: an unknown topic or partition,
   a target that is not a live node or not in the ISR, the leader itself, a leader that
   is not live or does not hold its leader key (failover's business, or a move still
   settling), a topic of one replica.
2. One compare-and-swap of the partition state on the revision the view showed: leader =
   target, epoch + 1, ISR unchanged. That write is the old leader's signal to stop: on
   seeing it, it takes no more publishes (E_FAILED_ON_NOT_WRITABLE / E_FAILED_ON_NOT_LEADER,
   which the partition-aware client retries after a new lookup), fails what it had not
   committed, and releases its leader key. Its pushes of the older epoch are refused by
   any follower that saw the new one, so it can commit nothing more.
3. The target closes its follower log and starts leading on the same log, once it holds
   the leader key (written the moment the old leader deleted its own). It has every
   committed batch (an ISR member acked each one before it was committed), so nothing
   acknowledged is lost; what it holds beyond that (pushed, not yet acknowledged) is
   kept, and a client's retry of it makes a duplicate (at-least-once).
4. The master waits (bounded) until its view shows the target holding the key.

A kill -9 of either side at any point leaves one leader: the state names one; a dead
target is replaced by failover (the least-loaded live ISR member, epoch + 1), and a dead
old leader's key goes with its lease, after which the target takes it.
One move at a time (`MOVE_IN_PROGRESS`).
"""

from __future__ import annotations

import asyncio
import time

import structlog

from isr.etcd import EtcdError
from isr.metadata import ClusterView, Conflict, Metadata
from isr.state import PartitionState

from .http import HTTPError

log = structlog.get_logger("nsqlookupd.moves")

SETTLE_S = 5.0  # longest a move waits for the target to hold the leader key


def check_leader_move(view: ClusterView, topic: str, partition: int,
                      to: str) -> tuple[PartitionState, PartitionState]:
    """Pure: (current state, state to write) of moving `topic`:`partition`'s leader to
    `to`, or HTTPError saying why not (404 unknown topic, 400 bad partition, 409 else)."""
    tv = view.topics.get(topic)
    if tv is None:
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    state = tv.partitions.get(partition)
    if state is None:
        raise HTTPError(400, "BAD_PARTITION",
                        detail=f"partition {partition} not in 0..{tv.meta.partitions - 1}")
    if tv.meta.replicas < 2:
        raise HTTPError(409, "NOT_REPLICATED",
                        detail="a topic of one replica has no other node to lead it")
    if to not in view.nodes:
        raise HTTPError(409, "NODE_NOT_LIVE", detail=f"{to} is not a live node")
    if state.leader == to:
        raise HTTPError(409, "ALREADY_LEADER", detail=f"{to} leads it already")
    if to not in state.isr:
        raise HTTPError(409, "NOT_IN_ISR",
                        detail=f"{to} is not in the ISR {list(state.isr)}")
    if state.leader not in view.nodes:
        raise HTTPError(409, "LEADER_NOT_LIVE",
                        detail="the partition has no live leader: failover elects one")
    if tv.leader_locks.get(partition) != state.leader:
        raise HTTPError(409, "LEADER_NOT_SETTLED",
                        detail="the leader does not hold its leader key yet")
    return state, state.evolve(leader=to, epoch=state.epoch + 1)


class LeaderMover:
    """The master's leader moves (module docstring). `view()` is the current view (raises
    HTTPError when this lookupd may not write), `changed()` an event pulsed per new view."""

    def __init__(self, metadata: Metadata, view, changed):
        self.metadata = metadata
        self.view = view
        self.changed = changed
        self.lock = asyncio.Lock()
        self.moves = 0  # leader moves this lookupd wrote
        self.last: dict | None = None  # the last move's outcome

    @property
    def busy(self) -> bool:
        return self.lock.locked()

    async def move(self, topic: str, partition: int, to: str, reason: str = "manual") -> dict:
        """Move the leader (module docstring); the outcome: {topic, partition, old, leader,
        epoch, settled, settle_ms}. HTTPError when refused."""
        if self.lock.locked():
            raise HTTPError(409, "MOVE_IN_PROGRESS", detail="one move at a time")
        async with self.lock:
            old, new = check_leader_move(self.view(), topic, partition, to)
            started = time.monotonic()
            try:
                written = await self.metadata.update_partition(topic, partition, new)
            except Conflict:
                raise HTTPError(409, "STATE_CHANGED",
                                detail="the partition state changed meanwhile: try again")
            except EtcdError as e:
                raise HTTPError(503, "CLUSTER_METADATA_UNAVAILABLE", error=f"etcd: {e}")
            self.moves += 1
            log.info("leader_move_written", topic=topic, partition=partition, old=old.leader,
                     leader=to, epoch=written.epoch, reason=reason)
            settled = await self._settled(topic, partition, written)
            result = {"topic": topic, "partition": partition, "old": old.leader,
                      "leader": to, "epoch": written.epoch, "settled": settled,
                      "settle_ms": round((time.monotonic() - started) * 1000, 1),
                      "reason": reason}
            self.last = result
            log.info("leader_moved" if settled else "leader_move_not_settled", **result)
            return result

    async def _settled(self, topic: str, partition: int, written: PartitionState) -> bool:
        """Whether, within SETTLE_S, the view shows the new leader holding its key (or a
        newer state: failover took over, e.g. the target died)."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            try:
                view = self.view()
            except HTTPError:
                return False
            tv = view.topics.get(topic)
            s = tv.partitions.get(partition) if tv is not None else None
            if s is None or s.epoch > written.epoch:
                return False
            if s.epoch == written.epoch and tv.leader_locks.get(partition) == written.leader:
                return True
            try:
                await asyncio.wait_for(self.changed().wait(), 0.2)
            except asyncio.TimeoutError:
                pass
        return False
