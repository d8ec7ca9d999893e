"""Failover: the nsqlookupd master gives a partition whose leader is gone a new leader.

Rules (isr/README.md and nsqlookupd/README.md, failover), decided by the pure `decide` on one ClusterView:
- a partition whose leader is not a live node (its registration is gone), or that has no
  leader, gets `placement.elect`: the least-loaded live ISR member, epoch + 1. Every ISR
  member holds every committed message, so any of them is safe; nobody outside the ISR is
  ever elected (no unclean election). With no live ISR member the state becomes (or
  stays) leaderless, epoch + 1 (the old leader is fenced), and it is listed in /info
  `leaderless` until an ISR member is live again, which is then elected;
- a partition whose leader is live but whose leader key (`topics/<t>/p/<n>/leader` = the
  leader's id, held under its lease) has been missing for longer than the lease TTL, as
  this lookupd saw it, gets the least-loaded OTHER live ISR member, epoch + 1. A live
  leader is never deposed for nobody: with no other live ISR member it stays;
- successive elections of one pass count the leaderships already given (load spreads).

`Failover` is the driver: on every new view (`poke`) and every TICK_S it decides on the
current view and writes the new states by CAS, up to MAX_BATCH of a topic in one
transaction (`Metadata.update_partitions`); a `Conflict` writes each of the batch on its
own (`update_partition`), and a Conflict there reads the state again and decides again.
Invariants: it writes only while this lookupd is master and its view is current (the
watch is connected); it never writes a
state it did not derive from the state it compares against; the key clock runs on every
lookupd, so a new master already knows since when a key is missing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Mapping

import structlog

from isr.background import stop_task
from isr.etcd import EtcdError
from isr.metadata import MAX_BATCH, ClusterView, Conflict, Metadata
from isr.placement import elect
from isr.state import BadValue, PartitionState

log = structlog.get_logger("nsqlookupd.failover")

TICK_S = 1.0  # the decision runs at least this often (a leader key's age is time-driven)
CAS_TRIES = 5  # a partition's CAS is tried this often in one pass (each after a read)

Partition = tuple[str, int]
KeyClock = dict[Partition, tuple[str, int, float]]  # -> (leader, epoch, key missing since)


@dataclass(frozen=True)
class Move:
    """One decision: `topic`:`partition` goes from `old` to `new` (epoch + 1)."""

    topic: str
    partition: int
    old: PartitionState
    new: PartitionState
    reason: str  # "leader_not_live" | "leaderless" | "leader_key_missing"


def key_clock(view: ClusterView, previous: Mapping[Partition, tuple[str, int, float]],
              now: float) -> KeyClock:
    """Pure: for each partition led by a live node that does not hold its leader key,
    since when it has been missing (kept from `previous` while leader and epoch stay)."""
    out: KeyClock = {}
    for t in view.topics.values():
        for n, s in t.partitions.items():
            if s.leader not in view.nodes or t.leader_locks.get(n) == s.leader:
                continue
            prev = previous.get((t.name, n))
            since = prev[2] if prev is not None and prev[:2] == (s.leader, s.epoch) else now
            out[(t.name, n)] = (s.leader, s.epoch, since)
    return out


def missing_since(clock: Mapping[Partition, tuple[str, int, float]], partition: Partition,
                  state: PartitionState) -> float | None:
    """Since when `state`'s leader has been without its key (None: it has it, or unknown)."""
    entry = clock.get(partition)
    return entry[2] if entry is not None and entry[:2] == (state.leader, state.epoch) else None


def decide_partition(state: PartitionState, live: set[str], since: float | None, now: float,
                     ttl: float, led: Mapping[str, int]) -> tuple[PartitionState, str] | None:
    """Pure: the next state of one partition and why, or None when it keeps its leader."""
    if state.leader in live:
        if since is None or now - since <= ttl:
            return None
        new = elect(state, live - {state.leader}, led)
        if new is None or new.leader is None:
            return None  # never depose a live leader for nobody
        return new, "leader_key_missing"
    new = elect(state, live, led)
    if new is None:
        return None
    return new, "leader_not_live" if state.leader is not None else "leaderless"


def leaderships(view: ClusterView) -> dict[str, int]:
    """Pure: per live node, the partitions it leads."""
    led: dict[str, int] = {}
    for t in view.topics.values():
        for s in t.partitions.values():
            if s.leader in view.nodes:
                led[s.leader] = led.get(s.leader, 0) + 1
    return led


def decide(view: ClusterView, clock: Mapping[Partition, tuple[str, int, float]], now: float,
           ttl: float, led: dict[str, int] | None = None) -> list[Move]:
    """Pure: every partition of `view` that needs a new leader (or none), as Moves.

    `led` (default: `leaderships(view)`) is updated with the moves as they are decided."""
    live = set(view.nodes)
    led = leaderships(view) if led is None else led
    moves = []
    for name in sorted(view.topics):
        t = view.topics[name]
        for n in sorted(t.partitions):
            s = t.partitions[n]
            d = decide_partition(s, live, missing_since(clock, (name, n), s), now, ttl, led)
            if d is None:
                continue
            new, reason = d
            if s.leader in live:
                led[s.leader] -= 1
            if new.leader is not None:
                led[new.leader] = led.get(new.leader, 0) + 1
            moves.append(Move(name, n, s, new, reason))
    return moves


class Failover:
    """The master's failover loop (module docstring). `current()` is the lookupd's view
    while it is current (None while etcd is unreachable), `is_master()` its role now."""

    def __init__(self, metadata: Metadata, ttl: float,
                 current: Callable[[], ClusterView | None], is_master: Callable[[], bool]):
        self.metadata = metadata
        self.ttl = ttl
        self.current = current
        self.is_master = is_master
        self.clock: KeyClock = {}
        self.elections = 0  # states written by this lookupd
        self._written: dict[Partition, int] = {}  # revision of the last state written
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> "Failover":
        self._task = asyncio.create_task(self._run(), name="failover")
        return self

    async def close(self) -> None:
        await stop_task(self._task)

    def poke(self) -> None:
        """Decide now (a new view, a new role)."""
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with asyncio.timeout(TICK_S):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            view = self.current()
            if view is None:
                continue
            now = loop.time()
            self.clock = key_clock(view, self.clock, now)
            if not self.is_master():
                continue
            try:
                await self.run_once(view, now)
            except Exception:  # a bug must not end the loop: said, tried again next tick
                log.exception("failover_pass_failed")

    async def run_once(self, view: ClusterView, now: float) -> None:
        """Decide on `view` and write every move: up to MAX_BATCH of one topic in one
        transaction (all by CAS), the batches concurrently."""
        self._written = {p: r for p, r in self._written.items() if p[0] in view.topics}
        led = leaderships(view)
        # a state this lookupd wrote, which its view does not show yet, is not decided on
        moves = [m for m in decide(view, self.clock, now, self.ttl, led)
                 if m.old.revision >= self._written.get((m.topic, m.partition), 0)]
        by_topic: dict[str, list[Move]] = {}
        for m in moves:
            by_topic.setdefault(m.topic, []).append(m)
        batches = [ms[i:i + MAX_BATCH] for ms in by_topic.values()
                   for i in range(0, len(ms), MAX_BATCH)]
        live = set(view.nodes)
        await asyncio.gather(*(self._write_batch(b, live, now, led) for b in batches))

    async def _write_batch(self, batch: list[Move], live: set[str], now: float,
                           led: Mapping[str, int]) -> None:
        """One transaction for the batch; on a Conflict, each move on its own."""
        if len(batch) == 1 or not self.is_master():
            await self._write(batch[0], live, now, led)
            return
        topic = batch[0].topic
        try:
            written = await self.metadata.update_partitions(
                topic, {m.partition: m.new for m in batch})
        except Conflict:
            await asyncio.gather(*(self._write(m, live, now, led) for m in batch))
            return
        except EtcdError as e:
            log.warning("failover_write_failed", topic=topic, partitions=len(batch),
                        error=str(e))
            return
        for m in batch:
            self._written[(topic, m.partition)] = written[m.partition].revision
        self.elections += len(batch)
        log.info("leaders_elected", topic=topic, count=len(batch),
                 moves=[f"{m.partition}:{m.old.leader}->{m.new.leader}@{m.new.epoch}"
                        for m in batch[:10]], reasons=sorted({m.reason for m in batch}))

    async def _write(self, move: Move, live: set[str], now: float,
                     led: Mapping[str, int]) -> None:
        """CAS `move.new`; on a Conflict read the state again and decide again on it."""
        p = (move.topic, move.partition)
        for _ in range(CAS_TRIES):
            if not self.is_master():
                return
            try:
                written = await self.metadata.update_partition(move.topic, move.partition,
                                                               move.new)
            except Conflict:
                try:
                    state = await self.metadata.read_partition(*p)
                except (EtcdError, BadValue) as e:
                    log.warning("failover_read_failed", topic=p[0], partition=p[1], error=str(e))
                    return
                if state is None:
                    return  # the topic is gone
                d = decide_partition(state, live, missing_since(self.clock, p, state), now,
                                     self.ttl, led)
                if d is None:
                    return
                move = Move(move.topic, move.partition, state, d[0], d[1])
                continue
            except EtcdError as e:
                log.warning("failover_write_failed", topic=p[0], partition=p[1], error=str(e))
                return
            self._written[p] = written.revision
            self.elections += 1
            log.info("leader_elected", topic=p[0], partition=p[1], old=move.old.leader,
                     leader=written.leader, epoch=written.epoch, isr=list(written.isr),
                     reason=move.reason)
            return
        log.warning("failover_cas_kept_losing", topic=p[0], partition=p[1], tries=CAS_TRIES)
