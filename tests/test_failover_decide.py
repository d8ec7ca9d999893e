"""nsqlookupd/failover.py, the pure part: who leads a partition after its leader is gone,
checked over every small case (3 nodes: every ISR order, leader, live set, key state)."""

from itertools import permutations

import pytest

from isr.metadata import ClusterView, TopicView
from isr.state import NodeInfo, PartitionState, TopicMeta
from nsqlookupd.failover import decide, decide_partition, key_clock, leaderships

NODES = ("a:1", "b:1", "c:1")
TTL = 2.0


def node(node_id: str) -> NodeInfo:
    host = node_id.split(":")[0]
    return NodeInfo(id=node_id, tcp=node_id, http=f"{host}:2", rpc=f"{host}:3",
                    hostname=host, version="1")


def view(live, topics: dict[str, list[PartitionState]], locks=None) -> ClusterView:
    locks = locks or {}
    tv = {name: TopicView(name, TopicMeta(partitions=len(states), replicas=len(states[0].isr)),
                          {}, dict(enumerate(states)), locks.get(name, {}))
          for name, states in topics.items()}
    return ClusterView(7, {n: node(n) for n in live}, {}, None, tv)


def subsets(items):
    return [tuple(x for i, x in enumerate(items) if mask >> i & 1)
            for mask in range(1 << len(items))]


CASES = [(isr, leader, live, key)
         for size in (1, 2, 3) for isr in permutations(NODES, size)
         for leader in (None, *isr) for live in subsets(NODES)
         for key in ("held", "missing_briefly", "missing_long")]


@pytest.mark.parametrize("led_b", [0, 5])
def test_every_small_case(led_b):
    """Each case against the rules written out again, independently of placement.py."""
    now = 100.0
    for isr, leader, live, key in CASES:
        state = PartitionState(leader=leader, isr=isr, catchup=(), epoch=4, revision=9)
        since = {"held": None, "missing_briefly": now - TTL, "missing_long": now - TTL - 0.1}[key]
        led = {"b:1": led_b}
        got = decide_partition(state, set(live), since, now, TTL, led)
        live_isr = [n for n in isr if n in live]
        case = (isr, leader, live, key, led_b)
        if leader in live:
            others = [n for n in live_isr if n != leader]
            if key != "missing_long" or not others:
                assert got is None, case  # a live leader with its key, or nobody to take over
                continue
            candidates, reason = others, "leader_key_missing"
        elif leader is None and not live_isr:
            assert got is None, case  # leaderless, and stays so: nothing to write
            continue
        else:
            candidates = live_isr
            reason = "leader_not_live" if leader is not None else "leaderless"
        assert got is not None, case
        new, why = got
        assert why == reason, case
        assert new.epoch == 5 and new.isr == isr and new.catchup == () and new.revision == 9
        if not candidates:
            assert new.leader is None, case  # fenced: epoch + 1, leaderless
            continue
        # the least-loaded candidate, ties: earliest in the ISR; never outside the ISR
        best = min(candidates, key=lambda n: (led.get(n, 0), isr.index(n)))
        assert new.leader == best and new.leader in isr and new.leader in live, case
    assert len(CASES) == 3 * 2 * 8 * 3 + 6 * 3 * 8 * 3 + 6 * 4 * 8 * 3


def test_elections_of_one_pass_spread_and_untouched_partitions_stay():
    dead = PartitionState(leader="a:1", isr=("a:1", "b:1", "c:1"), epoch=3, revision=5)
    fine = PartitionState(leader="b:1", isr=("b:1", "c:1"), epoch=2, revision=6)
    v = view(["b:1", "c:1"], {"t": [dead] * 4 + [fine]})
    assert leaderships(v) == {"b:1": 1}
    moves = decide(v, {}, 0.0, TTL)
    assert [(m.topic, m.partition, m.new.leader, m.new.epoch, m.reason) for m in moves] == [
        ("t", 0, "c:1", 4, "leader_not_live"), ("t", 1, "b:1", 4, "leader_not_live"),
        ("t", 2, "c:1", 4, "leader_not_live"), ("t", 3, "b:1", 4, "leader_not_live")]
    assert all(m.old == dead for m in moves)


def test_no_live_isr_member_leaves_it_leaderless_until_one_is_back():
    gone = PartitionState(leader="a:1", isr=("a:1",), epoch=1, revision=5)
    v = view(["b:1", "c:1"], {"r1": [gone]})
    (m,) = decide(v, {}, 0.0, TTL)
    assert m.new == PartitionState(leader=None, isr=("a:1",), epoch=2)  # never b or c
    assert v.leaderless() == [("r1", 0)]
    fenced = m.new.evolve(revision=8)
    assert decide(view(["b:1"], {"r1": [fenced]}), {}, 0.0, TTL) == []
    (back,) = decide(view(["a:1", "b:1"], {"r1": [fenced]}), {}, 0.0, TTL)
    assert (back.new.leader, back.new.epoch, back.reason) == ("a:1", 3, "leaderless")


def test_key_clock():
    s = PartitionState(leader="a:1", isr=("a:1", "b:1"), epoch=1, revision=5)
    v = view(["a:1", "b:1"], {"t": [s, s, s]}, locks={"t": {0: "a:1", 1: "b:1"}})
    clock = key_clock(v, {}, 10.0)
    # p0 holds its key; p1's key names another node; p2 has none
    assert clock == {("t", 1): ("a:1", 1, 10.0), ("t", 2): ("a:1", 1, 10.0)}
    assert key_clock(v, clock, 11.0) == clock  # kept: since when it is missing
    assert decide(v, key_clock(v, clock, 12.0), 12.0, TTL) == []  # TTL not passed yet
    moves = decide(v, clock, 12.5, TTL)
    assert [(m.partition, m.new.leader, m.reason) for m in moves] == [
        (1, "b:1", "leader_key_missing"), (2, "b:1", "leader_key_missing")]
    # a new epoch (or leader) starts the clock again; a key that shows stops it
    s2 = s.evolve(epoch=2)
    v2 = view(["a:1", "b:1"], {"t": [s2, s2, s]}, locks={"t": {0: "a:1"}})
    assert key_clock(v2, clock, 13.0) == {("t", 1): ("a:1", 2, 13.0),
                                          ("t", 2): ("a:1", 1, 10.0)}
    # a dead leader is not on the clock: it is not live, that rule is enough
    assert key_clock(view(["b:1"], {"t": [s]}), clock, 13.0) == {}


def test_a_live_leader_without_key_is_never_deposed_for_nobody():
    s = PartitionState(leader="a:1", isr=("a:1", "b:1"), epoch=1, revision=5)
    v = view(["a:1"], {"t": [s]})  # b is down: a is the only live ISR member
    clock = key_clock(v, {}, 0.0)
    assert decide(v, clock, 100.0, TTL) == []
