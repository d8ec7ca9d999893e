"""The master's moves of one partition: leader transfer within the ISR (no data copy) and
replica move (a new replica catches up and joins, then the old one leaves). One at a time.

Leader transfer:

The steps, and why each is safe:
1. `check_leader_move` (pure) refuses what must not move: an unknown topic or partition,
   a target that is not a live node or not in the ISR, the leader itself, a leader that
   is not live or does not hold its leader key (failover's business, or a move still
   settling). (A topic of one replica has another ISR member only while a replica move
   adds one: then its leader can move to it.)
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

Replica move (`from` -> `to`, both checked by `check_replica_move`; `from` in the ISR or
only catching up, e.g. a dead node the leader dropped, every other replica in sync):
1. CAS `to` into the partition's catch-up list (same epoch): `to` starts following, catches
   up from the leader and JOINs (isr/README.md: the leader CASes it into the ISR, epoch +
   1, only once it acked every commit);
2. wait (CATCHUP_S at most; else `to` is taken out of the catch-up list again, 504
   CATCHUP_TIMEOUT; as soon as `to` is no live node any more, the same, 409 NODE_NOT_LIVE)
   until the ISR holds `to`;
3. if `from` leads, a leader transfer to `to` first;
4. CAS `from` out of the ISR (epoch + 1) or the catch-up list: the leader stops pushing
   to it and it stops following (its files stay on its disk). An ISR that was whole never
   drops below the replica count.

One move at a time (`MOVE_IN_PROGRESS`); a CAS that loses to another writer (the leader's
own ISR changes) reads the state again and decides again (CAS_TRIES).
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
CATCHUP_S = 30.0  # longest a replica move waits for the new replica to join the ISR
CAS_TRIES = 10


def _movable(view: ClusterView, topic: str, partition: int, to: str):
    """(topic view, partition state) of a partition something may move to the live node
    `to`; else HTTPError (what both kinds of move refuse alike)."""
    tv = view.topics.get(topic)
    if tv is None:
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    state = tv.partitions.get(partition)
    if state is None:
        raise HTTPError(400, "BAD_PARTITION",
                        detail=f"partition {partition} not in 0..{tv.meta.partitions - 1}")
    if to not in view.nodes:
        raise HTTPError(409, "NODE_NOT_LIVE", detail=f"{to} is not a live node")
    return tv, state


def check_leader_move(view: ClusterView, topic: str, partition: int,
                      to: str) -> tuple[PartitionState, PartitionState]:
    """Pure: (current state, state to write) of moving `topic`:`partition`'s leader to
    `to`, or HTTPError saying why not (404 unknown topic, 400 bad partition, 409 else)."""
    tv, state = _movable(view, topic, partition, to)
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


def check_replica_move(view: ClusterView, topic: str, partition: int, frm: str,
                       to: str) -> PartitionState:
    """Pure: the current state, if moving `topic`:`partition`'s replica from `frm` to `to`
    may start; else HTTPError (404 unknown topic, 400 bad partition, 409 else)."""
    tv, state = _movable(view, topic, partition, to)
    if to in state.isr or to in state.catchup:
        raise HTTPError(409, "ALREADY_REPLICA", detail=f"{to} holds it already")
    if frm not in state.isr and frm not in state.catchup:
        raise HTTPError(409, "NOT_A_REPLICA", detail=f"{frm} is neither in the ISR "
                                                     f"{list(state.isr)} nor catching up")
    others = [x for x in state.isr if x != frm]
    if len(others) < tv.meta.replicas - 1 or set(state.catchup) - {frm}:
        raise HTTPError(409, "ISR_INCOMPLETE",
                        detail=f"ISR {list(state.isr)} of {tv.meta.replicas} replicas, "
                               f"catching up {list(state.catchup)}: every replica but "
                               f"{frm} must be in sync")
    if state.leader not in view.nodes or tv.leader_locks.get(partition) != state.leader:
        raise HTTPError(409, "LEADER_NOT_SETTLED",
                        detail="the partition has no settled live leader")
    return state


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

    def _take(self) -> asyncio.Lock:
        if self.lock.locked():
            raise HTTPError(409, "MOVE_IN_PROGRESS", detail="one move at a time")
        return self.lock

    async def move(self, topic: str, partition: int, to: str, reason: str = "manual") -> dict:
        """Move the leader (module docstring); the outcome: {topic, partition, old, leader,
        epoch, settled, settle_ms}. HTTPError when refused."""
        async with self._take():
            return await self._move_leader(topic, partition, to, reason)

    async def move_replica(self, topic: str, partition: int, frm: str, to: str,
                           reason: str = "manual") -> dict:
        """Move a replica (module docstring); the outcome: {topic, partition, from, to,
        isr, epoch, took_ms, leader_move}. HTTPError when refused or when it failed."""
        async with self._take():
            started = time.monotonic()
            check_replica_move(self.view(), topic, partition, frm, to)

            def add(s: PartitionState) -> PartitionState:
                if to in s.isr or to in s.catchup:
                    return s
                return s.evolve(catchup=(*s.catchup, to))

            await self._cas(topic, partition, add)
            log.info("replica_adding", topic=topic, partition=partition, node=to, frm=frm,
                     reason=reason)
            joined = await self._until(
                topic, partition, lambda s: to in s.isr or to not in self.view().nodes,
                CATCHUP_S)
            if not joined or to not in self._state(topic, partition).isr:
                await self._cas(topic, partition, lambda s: s.evolve(
                    catchup=tuple(x for x in s.catchup if x != to)) if to in s.catchup else s)
                if joined:  # its lease ended: it cannot catch up, no use waiting longer
                    raise HTTPError(409, "NODE_NOT_LIVE",
                                    detail=f"{to} left the cluster while catching up")
                raise HTTPError(504, "CATCHUP_TIMEOUT",
                                detail=f"{to} did not join the ISR within {CATCHUP_S:g} s")
            leader_move = None
            for attempt in range(CAS_TRIES):
                if self._state(topic, partition).leader != frm:
                    break
                try:
                    leader_move = await self._move_leader(topic, partition, to, reason)
                except HTTPError as e:  # the view lagging the join's own CAS: again
                    if e.code not in ("STATE_CHANGED", "LEADER_NOT_SETTLED") \
                            or attempt == CAS_TRIES - 1:
                        raise
                    await asyncio.sleep(0.2)

            def remove(s: PartitionState) -> PartitionState:
                if s.leader == frm:
                    raise HTTPError(409, "STATE_CHANGED", detail=f"{frm} leads it again")
                if frm not in s.isr and frm not in s.catchup:
                    return s
                isr = tuple(x for x in s.isr if x != frm)
                return s.evolve(isr=isr, catchup=tuple(x for x in s.catchup if x != frm),
                                epoch=s.epoch + 1 if isr != s.isr else s.epoch)

            written = await self._cas(topic, partition, remove)
            self.moves += 1
            result = {"topic": topic, "partition": partition, "from": frm, "to": to,
                      "isr": list(written.isr), "epoch": written.epoch,
                      "took_ms": round((time.monotonic() - started) * 1000, 1),
                      "leader_move": leader_move, "reason": reason}
            self.last = result
            log.info("replica_moved", **{k: v for k, v in result.items() if k != "leader_move"})
            return result

    def _state(self, topic: str, partition: int) -> PartitionState | None:
        tv = self.view().topics.get(topic)
        return tv.partitions.get(partition) if tv is not None else None

    async def _until(self, topic: str, partition: int, ok, timeout: float) -> bool:
        """Whether the view shows a state of the partition for which `ok` holds in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self._state(topic, partition)
            if s is None:
                raise HTTPError(404, "TOPIC_NOT_FOUND")
            if ok(s):
                return True
            try:
                async with asyncio.timeout(0.2):
                    await self.changed().wait()
            except TimeoutError:
                pass
        return False

    async def _cas(self, topic: str, partition: int, change) -> PartitionState:
        """Write `change(state)` by CAS on the state read from etcd, again on a Conflict."""
        for _ in range(CAS_TRIES):
            try:
                state = await self.metadata.read_partition(topic, partition)
                if state is None:
                    raise HTTPError(404, "TOPIC_NOT_FOUND")
                new = change(state)
                if new == state:
                    return state
                return await self.metadata.update_partition(topic, partition, new)
            except Conflict:
                await asyncio.sleep(0.05)
            except EtcdError as e:
                raise HTTPError(503, "CLUSTER_METADATA_UNAVAILABLE", error=f"etcd: {e}")
        raise HTTPError(409, "STATE_CHANGED", detail="the partition state kept changing")

    async def _move_leader(self, topic: str, partition: int, to: str, reason: str) -> dict:
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
                async with asyncio.timeout(0.2):
                    await self.changed().wait()
            except TimeoutError:
                pass
        return False
