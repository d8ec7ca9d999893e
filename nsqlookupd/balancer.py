"""The master's balancer and node drains: which move comes next (pure), and the loops
that make the moves one at a time through moves.LeaderMover.

Spread (decided here; the issue says "within a set spread"): per node, the partitions it
holds (ISR or catch-up) and the partitions it leads, each counted over the live nodes
that are not draining. The cluster is balanced when max - min of both is at most
`--balance-tolerance` (default 1). Replicas are evened first (a leader can only go where a
replica is), then leaders. A move is planned only between a node and one with at least
2 fewer, so every move lowers the sum of squares: a bounded number of moves. Among equal
counts the node with the higher load factor (isr/load.py) gives; among a node's
partitions the busiest moves first (what evens the load factors most). A replica move
(balancer or drain) never leaves a partition's replicas less spread over racks (nsqd
--rack: hosts by default) than it found them; a manual move is the operator's call.

A partition is moved by the balancer only when its leader is live and holds its key,
nothing is catching up, and its ISR is at least its replica count. A topic of one replica
moves like any other (every partition is a replicated log: the new replica catches up
from the leader, joins, leads, and the old one leaves).

Leaders are balanced at any time (`--leader-balance on`, the default, as Kafka's
auto.leader.rebalance): moving a leader inside its ISR copies no data. Its hysteresis: a
node takes leaders only once it has been live `--leader-balance-settle` (10 s) under its
current registration (a restart registers under a new lease, and settles again even when
no poll saw it down: a node that restarts in a loop is never given leaders to lose
again), a move goes only between
nodes whose counts differ by 2 or more (so none is ever undone while the nodes stay), and
at most one leader move a second. Replicas (data moves) are evened only inside
`--balance-window HH:MM-HH:MM` (local time of the lookupd; `00:00-24:00` always; a window
may wrap past midnight, `22:00-02:00`; empty, the default: never), at most one every
`--balance-interval`. Drains (`POST /node/drain`) and manual moves are not bound by the
window.

Drain of a node (live, or dead and still named in partition states): every partition it
holds gets its replica moved to the live, non-draining node holding the fewest
partitions that does not hold it (the leader is moved off first, inside the replica
move; a dead node's partitions once failover gave them a live leader, and once the
leader dropped it from the ISR). A partition that cannot move (no spare node, ISR
incomplete, its only replica dead) is retried every DRAIN_RETRY_S and listed in `stuck`. When the
node holds nothing, it is `removable` (shown in /cluster/stats). Drain states live in the
master's memory: a new master forgets them (drain again: it is idempotent).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from typing import Mapping

import structlog

from isr.background import stop_task
from isr.load import node_factors, partition_loads
from isr.metadata import ClusterView, TopicView
from isr.placement import spread_over_racks

from .http import HTTPError

log = structlog.get_logger("nsqlookupd.balancer")

DRAIN_RETRY_S = 1.0
LEADER_TICK_S = 1.0  # the most often the balancer looks, and moves a leader
Window = tuple[int, int]  # minutes from midnight: [start, end)


def parse_window(text: str) -> Window | None:
    """`HH:MM-HH:MM` -> (start, end) minutes; "" -> None (off). Raises ValueError."""
    if text == "":
        return None
    m = re.fullmatch(r"(\d\d):(\d\d)-(\d\d):(\d\d)", text)
    if not m:
        raise ValueError(f"balance window {text!r} is not HH:MM-HH:MM")
    h1, m1, h2, m2 = map(int, m.groups())
    start, end = h1 * 60 + m1, h2 * 60 + m2
    if h1 > 23 or m1 > 59 or m2 > 59 or end > 24 * 60:
        raise ValueError(f"balance window {text!r}: times are 00:00 to 24:00")
    if start == end:
        raise ValueError(f"balance window {text!r} is empty")
    return start, end


def in_window(window: Window | None, minute: int) -> bool:
    if window is None:
        return False
    start, end = window
    return start <= minute < end if start < end else minute >= start or minute < end


@dataclass(frozen=True)
class Plan:
    """One move: `kind` "leader" (frm leads, to leads next) or "replica" (frm's replica to
    to)."""

    kind: str
    topic: str
    partition: int
    frm: str
    to: str


def movable(view: ClusterView, tv: TopicView, n: int) -> bool:
    s = tv.partitions[n]
    return (s.leader in view.nodes and tv.leader_locks.get(n) == s.leader and not s.catchup
            and len(s.isr) >= tv.meta.replicas)


def keeps_racks(view: ClusterView, members, frm: str, to: str) -> bool:
    """Whether moving the replica on `frm` to `to` leaves the partition's replicas at least
    as spread over racks as they are (isr/placement.py: distinct racks while there are)."""
    racks = view.racks
    after = [to if n == frm else n for n in members]
    return spread_over_racks(after, racks) <= spread_over_racks(members, racks)


def counts(view: ClusterView, nodes) -> tuple[dict[str, int], dict[str, int]]:
    """(held, led) per node of `nodes`."""
    held = {n: 0 for n in nodes}
    led = {n: 0 for n in nodes}
    for tv in view.topics.values():
        for s in tv.partitions.values():
            for member in {*s.isr, *s.catchup}:
                if member in held:
                    held[member] += 1
            if s.leader in led:
                led[s.leader] += 1
    return held, led


def spread(c: Mapping[str, int]) -> int:
    return max(c.values()) - min(c.values()) if c else 0


def next_move(view: ClusterView, draining: set[str], tolerance: int,
              part_load: Mapping[tuple[str, int], float] | None = None,
              node_load: Mapping[str, float] | None = None, *, replicas: bool = True,
              settled: set[str] | None = None) -> Plan | None:
    """Pure: the balancer's next move, or None when balanced (or nothing can move).
    `replicas` False: leader moves only (outside the window). `settled`: the nodes that
    may take a leader (None: every node)."""
    nodes = sorted(set(view.nodes) - draining)
    if len(nodes) < 2:
        return None
    part_load = part_load or {}
    node_load = node_load or {}
    held, led = counts(view, nodes)
    parts = [(tv, n) for name, tv in sorted(view.topics.items()) for n in sorted(tv.partitions)
             if movable(view, tv, n)]

    def busiest(candidates):
        return min(candidates, key=lambda c: (-part_load.get((c[0].name, c[1]), 1.0),
                                              c[0].name, c[1]))

    def givers(c):
        return sorted(nodes, key=lambda u: (-c[u], -node_load.get(u, 0.0), u))

    def takers(c):
        return sorted(nodes, key=lambda v: (c[v], node_load.get(v, 0.0), v))

    if replicas and spread(held) > tolerance:
        for u in givers(held):
            for v in takers(held):
                if held[u] - held[v] < 2:
                    break
                cands = [(tv, n) for tv, n in parts if u in tv.partitions[n].isr
                         and v not in tv.partitions[n].isr
                         and keeps_racks(view, tv.partitions[n].isr, u, v)]
                # a follower's replica first: no leader move needed
                followed = [c for c in cands if c[0].partitions[c[1]].leader != u]
                if followed or cands:
                    tv, n = busiest(followed or cands)
                    return Plan("replica", tv.name, n, u, v)
    if spread(led) > tolerance:
        for u in givers(led):
            for v in takers(led):
                if led[u] - led[v] < 2:
                    break
                if settled is not None and v not in settled:
                    continue
                cands = [(tv, n) for tv, n in parts if tv.partitions[n].leader == u
                         and v in tv.partitions[n].isr]
                if cands:
                    tv, n = busiest(cands)
                    return Plan("leader", tv.name, n, u, v)
    return None


def drain_move(view: ClusterView, node: str, draining: set[str]) -> tuple[Plan | None, list[str]]:
    """Pure: (the next move taking a partition off `node`, or None; the partitions that
    hold it and cannot move now, as "topic:n: why")."""
    nodes = sorted(set(view.nodes) - draining - {node})
    held, _ = counts(view, nodes)
    stuck = []
    for name, tv in sorted(view.topics.items()):
        for n, s in sorted(tv.partitions.items()):
            if node not in s.isr and node not in s.catchup:
                continue
            others = [x for x in s.isr if x != node]
            if (s.leader not in view.nodes or tv.leader_locks.get(n) != s.leader
                    or len(others) < tv.meta.replicas - 1 or set(s.catchup) - {node}):
                stuck.append(f"{name}:{n}: ISR incomplete or leader not settled")
                continue
            others_free = [v for v in nodes if v not in s.isr and v not in s.catchup]
            spare = [v for v in others_free if keeps_racks(view, s.isr, node, v)]
            if spare:
                to = min(spare, key=lambda v: (held[v], v))
                return Plan("replica", name, n, node, to), stuck
            if s.leader == node:
                takers = [v for v in others if v in nodes]
                if takers:
                    return Plan("leader", name, n, node, takers[0]), stuck
            stuck.append(f"{name}:{n}: " + ("no live node on a rack it keeps apart to take "
                                             "its replica" if others_free else
                                             "no other live node to take its replica"))
    return None, stuck


class Balancer:
    """The balancing and draining loops of the master (module docstring). `cluster` is
    nsqlookupd.cluster.Cluster: `is_master`, `directory.view`, `mover`, `loads`."""

    def __init__(self, cluster, window: Window | None, tolerance: int, interval: float,
                 leaders: bool = True, settle: float = 10.0):
        self.cluster = cluster
        self.window = window
        self.tolerance = tolerance
        self.interval = interval
        self.leaders = leaders  # leader moves outside the window
        self.settle = settle
        # (node, registration) -> when this lookupd first saw it live under that registration
        self._live_since: dict[tuple[str, int], float] = {}
        self._replica_moved = 0.0  # monotonic time of the last replica move
        self.drains: dict[str, dict] = {}  # node -> {state, moved, stuck, error}
        self.moves = 0
        self.last_error: str | None = None
        self._drain_tasks: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None

    @property
    def draining(self) -> set[str]:
        return {n for n, d in self.drains.items() if d["state"] != "cancelled"}

    def start(self) -> "Balancer":
        if self.window is not None or self.leaders:
            self._task = asyncio.create_task(self._run(), name="balancer")
        return self

    async def close(self) -> None:
        await stop_task(self._task)
        for task in list(self._drain_tasks.values()):
            await stop_task(task)

    def open_now(self) -> bool:
        t = time.localtime()
        return in_window(self.window, t.tm_hour * 60 + t.tm_min)

    def settled(self, view: ClusterView) -> set[str]:
        """The live nodes seen live for `settle` seconds or more under their current
        registration (leader takers): a node that restarted, even between two polls and
        within its old lease's TTL, registers anew and settles again."""
        now = time.monotonic()
        live = {(n, view.registrations.get(n, 0)) for n in view.nodes}
        self._live_since = {key: self._live_since.get(key, now) for key in live}
        return {n for (n, _), since in self._live_since.items() if now - since >= self.settle}

    def plan(self, view: ClusterView, replicas: bool, settle: bool = True) -> Plan | None:
        """The next move; `settle` False: as if every node were settled (whether the
        cluster is balanced, for /cluster/stats)."""
        loads = self.cluster.loads.reports
        part = partition_loads(view, loads)
        node = {n: f["node_load_factor"] for n, f in node_factors(view, loads, part).items()}
        return next_move(view, self.draining, self.tolerance, part, node, replicas=replicas,
                         settled=self.settled(view) if settle else None)

    async def step(self) -> dict | None:
        """One balancer move now (HTTPError when it may not move): inside the window a
        replica or a leader move, outside it a leader move (with `leaders`); its outcome,
        or None when there is nothing to move."""
        replicas = self.open_now()
        if not replicas and not self.leaders:
            if self.window is None:
                raise HTTPError(409, "BALANCER_OFF", detail="nsqlookupd runs with "
                                "--leader-balance off and without --balance-window")
            raise HTTPError(409, "OUTSIDE_BALANCE_WINDOW",
                            detail=f"moves only within {format_window(self.window)}")
        return await self._move(replicas)

    async def _move(self, replicas: bool) -> dict | None:
        view = await self.cluster.master_view()
        plan = self.plan(view, replicas)
        if plan is None:
            return None
        result = await self._make(plan, "balance")
        self.moves += 1
        if plan.kind == "replica":
            self._replica_moved = time.monotonic()
        return result

    async def _make(self, plan: Plan, reason: str) -> dict:
        mover = self.cluster.mover
        if plan.kind == "leader":
            return await mover.move(plan.topic, plan.partition, plan.to, reason=reason)
        return await mover.move_replica(plan.topic, plan.partition, plan.frm, plan.to,
                                        reason=reason)

    async def _run(self) -> None:
        """Look every LEADER_TICK_S (or `interval`, when shorter): a leader move each time
        (with `leaders`), a replica move when the window is open and `interval` passed since
        the last one."""
        while True:
            await asyncio.sleep(min(LEADER_TICK_S, self.interval))
            view = self.cluster.directory.view
            if view is not None:
                self.settled(view)  # every lookupd keeps count, so a new master knows
            if not self.cluster.is_master or self.cluster.mover.busy:
                continue
            replicas = (self.open_now()
                        and time.monotonic() - self._replica_moved >= self.interval)
            if not replicas and not self.leaders:
                continue
            try:
                await self._move(replicas)
            except HTTPError as e:
                self.last_error = f"{e.code}: {e.extra.get('detail', '')}"
                log.info("balance_move_refused", error=self.last_error)
            except Exception:  # a bug must not end the loop: said, tried again later
                log.exception("balance_step_failed")

    # ---- drains --------------------------------------------------------------------

    async def drain(self, node: str, cancel: bool = False) -> dict:
        """Start (or cancel) draining `node`; its drain state."""
        view = await self.cluster.master_view()
        if cancel:
            task = self._drain_tasks.pop(node, None)
            if task is not None:
                task.cancel()
            if node in self.drains:
                self.drains[node]["state"] = "cancelled"
            return {"node": node, **self.drains.get(node, {"state": "not draining"})}
        if node not in view.nodes and not any(node in s.isr or node in s.catchup
                                              for tv in view.topics.values()
                                              for s in tv.partitions.values()):
            raise HTTPError(409, "NODE_NOT_LIVE",
                            detail=f"{node} is not a live node and holds no partition")
        if node not in self._drain_tasks or self._drain_tasks[node].done():
            self.drains[node] = {"state": "draining", "moved": 0, "stuck": [], "error": None}
            self._drain_tasks[node] = asyncio.create_task(self._drain(node),
                                                          name=f"drain {node}")
        return {"node": node, **self.drains[node]}

    async def _drain(self, node: str) -> None:
        d = self.drains[node]
        while True:
            if not self.cluster.is_master:
                await asyncio.sleep(DRAIN_RETRY_S)
                continue
            try:
                view = await self.cluster.master_view()
                plan, d["stuck"] = drain_move(view, node, self.draining)
                if plan is None:
                    if not d["stuck"]:
                        d["state"] = "removable"
                        log.info("node_drained", node=node, moved=d["moved"])
                        return
                    await asyncio.sleep(DRAIN_RETRY_S)
                    continue
                await self._make(plan, "drain")
                d["moved"] += 1
                d["error"] = None
            except HTTPError as e:
                d["error"] = f"{e.code}: {e.extra.get('detail', '')}"
                await asyncio.sleep(0.2 if e.code == "MOVE_IN_PROGRESS" else DRAIN_RETRY_S)
            except Exception as e:
                log.exception("drain_step_failed", node=node)
                d["error"] = f"{type(e).__name__}: {e}"
                await asyncio.sleep(DRAIN_RETRY_S)


def format_window(window: Window | None) -> str:
    if window is None:
        return ""
    return "-".join(f"{m // 60:02d}:{m % 60:02d}" for m in window)
