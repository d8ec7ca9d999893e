"""isr/placement.py: the spread properties of `place`, and the leader choice (pure)."""

import random
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from isr.placement import Load, choose_leader, elect, load_of, place
from isr.state import PartitionState


def ids(n):
    return [f"10.0.0.{i}:4150" for i in range(n)]


def spread(counter, nodes):
    values = [counter.get(n, 0) for n in nodes]
    return max(values) - min(values)


def check_shape(result, nodes, partition_num, replicas):
    assert len(result) == partition_num
    for members in result:
        assert len(members) == replicas
        assert len(set(members)) == replicas
        assert set(members) <= set(nodes)


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 12), st.integers(1, 200), st.integers(1, 5), st.randoms())
def test_spread_without_load(node_num, partition_num, replicas, rnd):
    replicas = min(replicas, node_num)
    nodes = ids(node_num)
    result = place(nodes, partition_num, replicas)
    check_shape(result, nodes, partition_num, replicas)
    leaders = Counter(m[0] for m in result)
    held = Counter(n for m in result for n in m)
    assert spread(leaders, nodes) <= 1
    assert spread(held, nodes) <= 1
    shuffled = nodes[:]
    rnd.shuffle(shuffled)
    assert place(shuffled, partition_num, replicas) == result  # deterministic, order-free


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.integers(1, 64), st.integers(1, 5), st.data())
def test_spread_with_load(node_num, partition_num, replicas, data):
    replicas = min(replicas, node_num)
    nodes = ids(node_num)
    load = {}
    for n in nodes:
        held = data.draw(st.integers(0, 50))
        load[n] = Load(led=data.draw(st.integers(0, held)), held=held)
    result = place(nodes, partition_num, replicas, load)
    check_shape(result, nodes, partition_num, replicas)
    held_after = Counter({n: load[n].held for n in nodes})
    held_after.update(n for m in result for n in m)
    before = spread(Counter({n: load[n].held for n in nodes}), nodes)
    assert spread(held_after, nodes) <= max(before, 1)
    # water-filling: each partition goes to nodes holding no more than any node left out
    held = {n: load[n].held for n in nodes}
    for members in result:
        outside = [held[n] for n in nodes if n not in members]
        if outside:
            assert max(held[n] for n in members) <= min(outside)
        for n in members:
            held[n] += 1
    assert place(nodes, partition_num, replicas, load) == result


def test_new_node_gets_the_new_work():
    nodes = ids(3)
    load = {nodes[0]: Load(10, 20), nodes[1]: Load(10, 20)}
    result = place(nodes, 4, 1, load)
    assert [m[0] for m in result] == [nodes[2]] * 4


def test_balanced_leaders_need_paths():
    """Greedy alone can leave leaders uneven; the path moves must fix every case here."""
    for node_num in range(1, 9):
        for replicas in range(1, min(5, node_num) + 1):
            for partition_num in range(1, 40):
                result = place(ids(node_num), partition_num, replicas)
                assert spread(Counter(m[0] for m in result), ids(node_num)) <= 1


def test_big_topic_is_quick():
    result = place(ids(50), 1024, 5)
    assert spread(Counter(m[0] for m in result), ids(50)) <= 1


@pytest.mark.parametrize("args", [
    (ids(3), 0, 1), (ids(3), 1025, 1), (ids(3), 4, 0), (ids(3), 4, 6), (ids(3), 4, 4),
    (["a:1", "a:1"], 2, 1), ([], 1, 1),
])
def test_impossible(args):
    with pytest.raises(ValueError):
        place(*args)


def test_choose_leader_and_elect():
    a, b, c = ids(3)
    assert choose_leader([a, b, c], {b, c}, {b: 5, c: 2}) == c
    assert choose_leader([a, b, c], {b, c}, {b: 2, c: 2}) == b  # tie: ISR order
    assert choose_leader([a], {b}) is None
    state = PartitionState(a, (a, b), epoch=4, revision=10)
    assert elect(state, {a, b}) is None  # leader alive: nothing to do
    new = elect(state, {b, c})
    assert (new.leader, new.isr, new.epoch, new.revision) == (b, (a, b), 5, 10)
    gone = elect(state, {c})
    assert gone.leader is None and gone.epoch == 5
    assert elect(gone, {c}) is None  # still no one: no new epoch
    assert elect(gone, {a}).leader == a


def test_load_of():
    a, b, c = ids(3)
    states = [PartitionState(a, (a, b)), PartitionState(b, (b,), (c,)), PartitionState(None, (a,))]
    assert load_of(states) == {a: Load(1, 2), b: Load(1, 2), c: Load(0, 1)}


def test_random_big_inputs_stay_balanced():
    rnd = random.Random(7)
    for _ in range(20):
        nodes = ids(rnd.randint(1, 30))
        replicas = rnd.randint(1, min(5, len(nodes)))
        result = place(nodes, rnd.randint(1, 1024), replicas)
        assert spread(Counter(m[0] for m in result), nodes) <= 1
        assert spread(Counter(n for m in result for n in m), nodes) <= 1


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 60), st.integers(1, 5))
def test_replicas_go_to_distinct_racks_while_there_are_racks(hosts, per_host, partition_num,
                                                             replicas):
    """Several nodes a host (one nsqd per core), the host their rack: a partition's replicas
    are on min(replicas, hosts) hosts, as even as can be over them; leaders per node and
    replicas per node keep the spread they have without racks when every host has as
    many nodes."""
    nodes = [f"10.0.0.{h}:{4150 + 2 * k}" for h in range(hosts) for k in range(per_host)]
    replicas = min(replicas, len(nodes))
    racks = {n: n.rpartition(":")[0] for n in nodes}
    result = place(nodes, partition_num, replicas, racks=racks)
    check_shape(result, nodes, partition_num, replicas)
    for members in result:
        on_rack = Counter(racks[n] for n in members)
        assert len(on_rack) == min(replicas, hosts), members
        assert max(on_rack.values()) - min(on_rack.values()) <= 1, members
    held = Counter(n for m in result for n in m)
    assert spread(held, nodes) <= 1
    assert spread(Counter(m[0] for m in result), nodes) <= 1


def test_racks_change_nothing_when_each_node_is_its_own():
    nodes = ids(5)
    assert place(nodes, 40, 3, racks={n: n for n in nodes}) == place(nodes, 40, 3)
    assert place(nodes, 40, 3, racks={}) == place(nodes, 40, 3)


def test_two_nodes_on_one_host_never_hold_one_partition_twice():
    a1, a2, b1, c1 = "10.0.0.1:4150", "10.0.0.1:4152", "10.0.0.2:4150", "10.0.0.3:4150"
    racks = {a1: "a", a2: "a", b1: "b", c1: "c"}
    for members in place([a1, a2, b1, c1], 12, 3, racks=racks):
        assert {racks[n] for n in members} == {"a", "b", "c"}, members
    for members in place([a1, a2, b1], 12, 2, racks=racks):
        assert {racks[n] for n in members} == {"a", "b"}, members
