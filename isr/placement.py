"""Pure placement decisions: where a new topic's partitions go, who leads a leaderless one.

No etcd, no clock, no randomness: the same input gives the same answer, whatever the
order of the node ids given.

`place` spreads a new topic over the live nodes: each partition gets `replicas` distinct
nodes, leader first. Replicas go to the nodes holding the fewest partitions (existing
load counted), so the new replicas per node differ by at most 1 when there is no load.
Given the nodes' racks (failure domains: hosts, by default), a partition's replicas are
on as many racks as there are: never two on one rack while another rack has none of
them (Kafka's rack-aware assignment); with fewer racks than replicas, as even as can be.
Leaders are then chosen inside each partition's replicas, and balanced by moving
leaderships along alternating paths (partition led by u -> another replica v of it)
until no path joins a node u to a node v leading 2 or more fewer: that is the
optimality condition of a semi-matching, so leaders per node differ by at most 1
whenever the replica sets allow it (they always do with balanced sets).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .state import MAX_PARTITIONS, MAX_REPLICAS, PartitionState


@dataclass(frozen=True)
class Load:
    """What a node carries already: partitions it leads, partitions it holds (leading or not)."""

    led: int = 0
    held: int = 0


def load_of(states: Iterable[PartitionState]) -> dict[str, Load]:
    """Per node, the partitions led and held (ISR or catchup) in `states`."""
    led: dict[str, int] = {}
    held: dict[str, int] = {}
    for s in states:
        if s.leader is not None:
            led[s.leader] = led.get(s.leader, 0) + 1
        for n in (*s.isr, *s.catchup):
            held[n] = held.get(n, 0) + 1
    return {n: Load(led.get(n, 0), held.get(n, 0)) for n in held.keys() | led.keys()}


def place(nodes: Sequence[str], partition_num: int, replicas: int,
          load: Mapping[str, Load] | None = None,
          racks: Mapping[str, str] | None = None) -> list[list[str]]:
    """Each partition's replicas, leader first. `racks`: node -> rack (`rack_of`). Raises
    ValueError for impossible requests."""
    order = sorted(set(nodes))
    if len(order) != len(nodes):
        raise ValueError("a node id is given twice")
    if not 1 <= partition_num <= MAX_PARTITIONS:
        raise ValueError(f"partition_num {partition_num} not in 1..{MAX_PARTITIONS}")
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"replicas {replicas} not in 1..{MAX_REPLICAS}")
    if replicas > len(order):
        raise ValueError(f"replicas {replicas} > live nodes {len(order)}")
    load = load or {}
    index = {n: i for i, n in enumerate(order)}
    led = {n: load.get(n, Load()).led for n in order}
    held = {n: load.get(n, Load()).held for n in order}

    rack = {n: rack_of(n, racks or {}) for n in order}
    rack_held: dict[str, int] = {}
    for n in order:
        rack_held[rack[n]] = rack_held.get(rack[n], 0) + held[n]
    sets: list[list[str]] = []
    for _ in range(partition_num):
        chosen: list[str] = []
        on_rack: dict[str, int] = {}
        for _ in range(replicas):
            # a rack this partition uses least, then the least held node, on the least
            # held rack (so the racks fill evenly and none is left for the last replicas)
            n = min((n for n in order if n not in chosen),
                    key=lambda n: (on_rack.get(rack[n], 0), held[n], rack_held[rack[n]],
                                   led[n], index[n]))
            chosen.append(n)
            on_rack[rack[n]] = on_rack.get(rack[n], 0) + 1
        for n in chosen:
            held[n] += 1
            rack_held[rack[n]] += 1
        sets.append(chosen)

    leaders: list[str] = []
    for members in sets:
        leader = min(members, key=lambda n: (led[n], index[n]))
        led[leader] += 1
        leaders.append(leader)
    _balance_leaders(sets, leaders, led, index)
    return [[leaders[p]] + [n for n in members if n != leaders[p]]
            for p, members in enumerate(sets)]


def _balance_leaders(sets: list[list[str]], leaders: list[str], led: dict[str, int],
                     index: dict[str, int]) -> None:
    """Move leaderships along alternating paths while one lowers a spread of 2 or more."""
    while True:
        led_by: dict[str, list[int]] = {n: [] for n in led}
        for p, leader in enumerate(leaders):
            led_by[leader].append(p)
        for start in sorted(led, key=lambda n: (-led[n], index[n])):
            path = _path_to_lighter(start, sets, led_by, led, index)
            if path:
                for p, new_leader in path:
                    leaders[p] = new_leader
                led[start] -= 1
                led[path[-1][1]] += 1
                break
        else:
            return


def _path_to_lighter(start: str, sets, led_by, led, index) -> list[tuple[int, str]] | None:
    """Breadth-first: [(partition, its new leader), ...] from `start` to a node with
    at most led[start] - 2, or None."""
    parent: dict[str, tuple[str, int] | None] = {start: None}
    queue = deque([start])
    while queue:
        u = queue.popleft()
        for p in led_by[u]:
            for v in sorted(sets[p], key=index.__getitem__):
                if v in parent:
                    continue
                parent[v] = (u, p)
                if led[v] <= led[start] - 2:
                    path = []
                    while parent[v] is not None:
                        u_prev, p_prev = parent[v]
                        path.append((p_prev, v))
                        v = u_prev
                    return path[::-1]
                queue.append(v)
    return None


def rack_of(node: str, racks: Mapping[str, str]) -> str:
    """A node's rack: as `racks` says, else the host part of its id (nsqd's default: a
    node that is not live now, or registered before racks, is taken to be there)."""
    return racks.get(node) or node.rpartition(":")[0] or node


def spread_over_racks(members: Sequence[str], racks: Mapping[str, str]) -> tuple[int, ...]:
    """Replicas per rack of one partition, most first: a move must never make it worse
    (compare with `<`: fewer on the fullest rack is better)."""
    count: dict[str, int] = {}
    for n in members:
        r = rack_of(n, racks)
        count[r] = count.get(r, 0) + 1
    return tuple(sorted(count.values(), reverse=True))


def choose_leader(isr: Sequence[str], live: Iterable[str],
                  led: Mapping[str, int] | None = None) -> str | None:
    """The live ISR member leading the fewest partitions (ties: earlier in the ISR)."""
    live = set(live)
    led = led or {}
    candidates = [n for n in isr if n in live]
    if not candidates:
        return None
    return min(candidates, key=lambda n: (led.get(n, 0), isr.index(n)))


def elect(state: PartitionState, live: Iterable[str],
          led: Mapping[str, int] | None = None) -> PartitionState | None:
    """The next state of a partition whose leader is gone, or None if nothing changes.

    A new leader (or none, when no ISR member is live) raises the epoch, which fences
    the old leader; the ISR itself is replication's business and stays as it is.
    """
    live = set(live)
    if state.leader is not None and state.leader in live:
        return None
    leader = choose_leader(state.isr, live, led)
    if leader is None and state.leader is None:
        return None
    return state.evolve(leader=leader, epoch=state.epoch + 1)
