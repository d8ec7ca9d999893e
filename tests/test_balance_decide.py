"""The pure parts of load balancing (no etcd, no sockets): load reports' codec and load
factors, the balance window, the balancer's and the drain's next move (driven to the end
on simulated views: bounded, balanced, never an incomplete ISR), and the refusals of a
leader or replica move."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from isr.load import NodeLoad, PartitionLoad, node_factors, partition_loads
from isr.metadata import ClusterView, TopicView
from isr.state import BadValue, NodeInfo, PartitionState, TopicMeta
from nsqlookupd.balancer import (Plan, counts, drain_move, in_window, next_move, parse_window,
                                 spread)
from nsqlookupd.http import HTTPError
from nsqlookupd.loads import cluster_stats
from nsqlookupd.moves import check_leader_move, check_replica_move

A, B, C, D = "10.0.0.1:4150", "10.0.0.2:4150", "10.0.0.3:4150", "10.0.0.4:4150"


def info(node: str) -> NodeInfo:
    host = node.split(":")[0]
    return NodeInfo(id=node, tcp=node, http=f"{host}:4151", rpc=f"{host}:4250",
                    hostname=host, version="1.3.0")


def view(nodes, topics: dict[str, tuple[int, list[PartitionState]]], locks=True) -> ClusterView:
    """topics: name -> (replicas, states); every live leader holds its key when `locks`."""
    tvs = {}
    for name, (replicas, states) in topics.items():
        meta = TopicMeta(partitions=len(states), replicas=replicas, min_isr=1)
        parts = {n: s.evolve(revision=10 + n) for n, s in enumerate(states)}
        held = {n: s.leader for n, s in parts.items() if locks and s.leader in nodes}
        tvs[name] = TopicView(name, meta, {}, parts, held)
    return ClusterView(100, {n: info(n) for n in nodes}, {}, None, tvs, [])


def apply(v: ClusterView, plan) -> ClusterView:
    """The state a move leads to, as the move makes it (leader: epoch + 1; replica: `to`
    joins, `frm` leaves, the leader moved off `frm` first)."""
    topics = {}
    for name, tv in v.topics.items():
        states = [tv.partitions[n] for n in sorted(tv.partitions)]
        if name == plan.topic:
            s = states[plan.partition]
            if plan.kind == "leader":
                s = s.evolve(leader=plan.to, epoch=s.epoch + 1)
            else:
                isr = tuple(x for x in s.isr if x != plan.frm) + (plan.to,)
                s = s.evolve(isr=isr, leader=plan.to if s.leader == plan.frm else s.leader,
                             epoch=s.epoch + 2)
            states[plan.partition] = s
        topics[name] = (tv.meta.replicas, states)
    return view(set(v.nodes), topics)


def skewed(nodes, partitions: int, replicas: int, leader: str) -> list[PartitionState]:
    out = []
    for n in range(partitions):
        others = [x for x in nodes if x != leader]
        members = [leader] + [others[(n + i) % len(others)] for i in range(replicas - 1)]
        out.append(PartitionState(leader=leader, isr=tuple(members), epoch=1))
    return out


def run_balancer(v: ClusterView, draining=frozenset(), tolerance=1, limit=500):
    moves = []
    while True:
        plan = next_move(v, set(draining), tolerance)
        if plan is None:
            return v, moves
        moves.append(plan)
        assert len(moves) <= limit, moves[-5:]
        v = apply(v, plan)


# ---- windows ----------------------------------------------------------------------------


def test_balance_window_parse_and_membership():
    assert parse_window("") is None
    assert parse_window("00:00-24:00") == (0, 1440)
    always = parse_window("00:00-24:00")
    assert all(in_window(always, m) for m in range(1440))
    night = parse_window("02:00-06:00")
    assert in_window(night, 120) and in_window(night, 359)
    assert not in_window(night, 360) and not in_window(night, 119)
    wrap = parse_window("22:00-02:00")
    assert in_window(wrap, 23 * 60) and in_window(wrap, 30) and not in_window(wrap, 12 * 60)
    assert not in_window(None, 0)
    for bad in ("2-6", "02:00", "25:00-26:00", "02:60-03:00", "10:00-10:00", "00:00-24:01",
                "24:00-01:00", " 02:00-06:00"):
        with pytest.raises(ValueError):
            parse_window(bad)


# ---- load reports -----------------------------------------------------------------------


def test_load_report_round_trip_and_factors():
    report = NodeLoad(A, 1_700_000_000_000, 2.0, 0.25, {
        "t/0": PartitionLoad(2000.0, 2 * 1_048_576.0, 500, 7, True),
        "t/1": PartitionLoad(10.0, 100.0, 300, 0, False)})
    again = NodeLoad.decode(report.encode())
    assert again == report
    assert again.led == 1 and again.followed == 1
    body = json.loads(report.encode())
    assert body["partitions_led"] == 1 and body["msgs_per_s"] == 2000.0
    assert report.partitions["t/0"].load_factor == pytest.approx(1 + 2 + 2)
    v = view({A, B}, {"t": (2, [PartitionState(leader=A, isr=(A, B), epoch=1),
                                PartitionState(leader=B, isr=(B, A), epoch=1)])})
    part = partition_loads(v, {A: report})
    assert part == {("t", 0): pytest.approx(5.0), ("t", 1): 1.0}  # B did not report
    f = node_factors(v, {A: report}, part)
    assert f[A]["leader_load_factor"] == 5.0 and f[A]["partitions_led"] == 1
    assert f[A]["node_load_factor"] == pytest.approx(5.0 + 0.25 + 4 * 0.25)
    assert f[B]["node_load_factor"] == pytest.approx(1.0 + 0.25)
    stats = cluster_stats(v, {A: report}, 1, True, 1_700_000_001_000)
    assert stats["stable"] is True and stats["topn_topics"] == [{"topic": "t", "load_factor": 6.0}]
    a = next(n for n in stats["node_stat_list"] if n["id"] == A)
    assert a["tcp_port"] == 4150 and a["http_port"] == 4151 and a["report_age_ms"] == 1000
    b = next(n for n in stats["node_stat_list"] if n["id"] == B)
    assert b["cpu"] is None and b["leader_load_factor"] == 1.0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.builds(lambda o: json.dumps(o).encode(), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=5))))
def test_any_load_value_decodes_or_is_a_bad_value(raw):
    try:
        NodeLoad.decode(raw, "k")
    except BadValue:
        pass


def test_malformed_reports_are_bad_values():
    good = json.loads(NodeLoad(A, 1, 2.0, 0.1, {"t/0": PartitionLoad()}).encode())
    for change in ({"node": "no port"}, {"cpu": -1}, {"cpu": "x"}, {"ts_ms": 1.5},
                   {"partitions": {"t/0": [1, 2, 3]}}, {"partitions": {"t0": [0, 0, 0, 0, True]}},
                   {"partitions": {"t/0": [0, 0, 0.5, 0, True]}}, {"partitions": []}):
        with pytest.raises(BadValue):
            NodeLoad.decode(json.dumps({**good, **change}).encode())
    bad = dict(good)
    del bad["cpu"]
    with pytest.raises(BadValue):
        NodeLoad.decode(json.dumps(bad).encode())


# ---- the balancer -----------------------------------------------------------------------


@pytest.mark.parametrize("partitions,replicas", [(24, 3), (24, 2), (7, 2), (6, 3), (1, 3)])
def test_skewed_leaders_converge_within_a_bounded_number_of_moves(partitions, replicas):
    nodes = [A, B, C]
    v = view(set(nodes), {"t": (replicas, skewed(nodes, partitions, replicas, A))})
    end, moves = run_balancer(v)
    held, led = counts(end, nodes)
    assert spread(led) <= 1 and spread(held) <= 1
    if replicas == 3:  # every node holds every partition: only leaders move, each once
        assert all(m.kind == "leader" for m in moves)
        assert len(moves) == led[B] + led[C]
    else:  # A holds every partition: replicas even out first, each move a step down
        start_held, start_led = counts(v, nodes)
        assert len(moves) <= (sum(x * x for x in start_held.values())
                              + sum(x * x for x in start_led.values()))


def test_a_new_node_gets_replicas_then_leaders():
    nodes = [A, B, C]
    v = view({A, B, C, D}, {"t": (2, skewed(nodes, 12, 2, A)),
                            "u": (3, skewed(nodes, 4, 3, B))})
    end, moves = run_balancer(v)
    held, led = counts(end, [A, B, C, D])
    assert spread(held) <= 1 and spread(led) <= 1 and held[D] > 0 and led[D] > 0
    kinds = [m.kind for m in moves]
    assert kinds.index("leader") > kinds.index("replica")
    # each move lowers the sum of squares: bounded by it
    start_held, start_led = counts(v, [A, B, C, D])
    bound = sum(x * x for x in start_held.values()) + sum(x * x for x in start_led.values())
    assert len(moves) <= bound


def test_the_balancer_never_moves_an_incomplete_partition():
    short = PartitionState(leader=A, isr=(A,), catchup=(B,), epoch=3)
    v = view({A, B, C}, {"t": (2, [short] * 4)})
    assert next_move(v, set(), 1) is None
    v = view({A, B, C}, {"t": (2, [PartitionState(leader=A, isr=(A, B), epoch=1)] * 4)},
             locks=False)  # leaders without their keys: not settled
    assert next_move(v, set(), 1) is None


def test_a_topic_of_one_replica_is_evened_like_any_other():
    """Every partition is a replicated log, one replica too: its replica moves (issue 29)."""
    v = view({A, B, C}, {"t": (1, [PartitionState(leader=A, isr=(A,), epoch=1)] * 6)})
    end, moves = run_balancer(v)
    assert moves and all(m.kind == "replica" and m.frm == A for m in moves)
    held, led = counts(end, [A, B, C])
    assert held == led == {A: 2, B: 2, C: 2}


def test_tolerance_and_draining_nodes():
    nodes = [A, B, C]
    v = view(set(nodes), {"t": (3, skewed(nodes, 6, 3, A))})
    assert next_move(v, set(), 6) is None  # 6 - 0 <= tolerance
    end, moves = run_balancer(v, draining={C})
    assert all(m.to != C and m.frm != C for m in moves)
    _, led = counts(end, [A, B])
    assert led == {A: 3, B: 3}


def test_drain_moves_everything_off_then_nothing():
    nodes = [A, B, C, D]
    v = view(set(nodes), {"t": (2, skewed([A, B, C], 9, 2, A)),
                          "one": (1, [PartitionState(leader=B, isr=(B,), epoch=1)])})
    moved = 0
    while True:
        plan, stuck = drain_move(v, A, {A})
        if plan is None:
            break
        assert plan.frm == A and plan.to != A
        v = apply(v, plan)
        moved += 1
        assert moved < 50
    assert stuck == []
    held, led = counts(v, nodes)
    assert held[A] == 0 and led[A] == 0 and moved == 9
    plan, stuck = drain_move(v, B, {A, B})  # one replica moves too
    assert plan.kind == "replica" and (plan.topic, plan.frm) == ("one", B), plan
    assert plan.to in (C, D) and stuck == [], (plan, stuck)


def test_drain_without_a_spare_node_moves_the_leader_and_says_why():
    v = view({A, B, C}, {"t": (3, skewed([A, B, C], 2, 3, A))})
    plan, _ = drain_move(v, A, {A})
    assert plan.kind == "leader" and plan.frm == A
    v = apply(apply(v, plan), drain_move(apply(v, plan), A, {A})[0])
    plan, stuck = drain_move(v, A, {A})
    assert plan is None and len(stuck) == 2 and "no other live node" in stuck[0]


# ---- refusals of a move -----------------------------------------------------------------


def refused(fn, *args) -> tuple[int, str]:
    with pytest.raises(HTTPError) as e:
        fn(*args)
    return e.value.status, e.value.code


def test_leader_move_refusals():
    v = view({A, B, C}, {"t": (2, [PartitionState(leader=A, isr=(A, B), epoch=4)]),
                         "one": (1, [PartitionState(leader=A, isr=(A,), epoch=1)])})
    assert refused(check_leader_move, v, "nope", 0, B) == (404, "TOPIC_NOT_FOUND")
    assert refused(check_leader_move, v, "t", 1, B) == (400, "BAD_PARTITION")
    assert refused(check_leader_move, v, "one", 0, B) == (409, "NOT_IN_ISR")
    assert refused(check_leader_move, v, "t", 0, D) == (409, "NODE_NOT_LIVE")
    assert refused(check_leader_move, v, "t", 0, A) == (409, "ALREADY_LEADER")
    assert refused(check_leader_move, v, "t", 0, C) == (409, "NOT_IN_ISR")
    old, new = check_leader_move(v, "t", 0, B)
    assert new.leader == B and new.epoch == 5 and new.isr == old.isr
    assert new.revision == old.revision  # the CAS compares the state the view showed
    dead = view({B, C}, {"t": (2, [PartitionState(leader=A, isr=(A, B), epoch=4)])})
    assert refused(check_leader_move, dead, "t", 0, B) == (409, "LEADER_NOT_LIVE")
    unsettled = view({A, B}, {"t": (2, [PartitionState(leader=A, isr=(A, B), epoch=4)])},
                     locks=False)
    assert refused(check_leader_move, unsettled, "t", 0, B) == (409, "LEADER_NOT_SETTLED")


def test_replica_move_refusals():
    v = view({A, B, C}, {"t": (2, [PartitionState(leader=A, isr=(A, B), epoch=4),
                                   PartitionState(leader=A, isr=(A,), catchup=(B,), epoch=5)])})
    assert refused(check_replica_move, v, "t", 0, A, D) == (409, "NODE_NOT_LIVE")
    assert refused(check_replica_move, v, "t", 0, A, B) == (409, "ALREADY_REPLICA")
    assert refused(check_replica_move, v, "t", 0, C, C) == (409, "NOT_A_REPLICA")
    assert refused(check_replica_move, v, "t", 1, A, C) == (409, "ISR_INCOMPLETE")
    assert refused(check_replica_move, v, "t", 2, A, C) == (400, "BAD_PARTITION")
    assert check_replica_move(v, "t", 0, B, C).leader == A
    # a replica only catching up (a dead node the leader dropped) may be moved away
    assert check_replica_move(v, "t", 1, B, C).catchup == (B,)
    three = view({A, B, C, D}, {"t": (3, [PartitionState(leader=A, isr=(A,), catchup=(B, C),
                                                         epoch=5)])})
    assert refused(check_replica_move, three, "t", 0, B, D) == (409, "ISR_INCOMPLETE")


def test_every_partition_case_on_three_nodes_is_decided_without_error():
    """Every leader / ISR / catch-up combination of one partition on 3 nodes, any of them
    down or draining: next_move and drain_move answer, and never plan a move of an
    incomplete partition or to a node that is down."""
    nodes = [A, B, C]
    states = []
    for leader in [None, *nodes]:
        for r in range(1, 4):
            for isr in itertools.permutations(nodes, r):
                if leader is not None and leader not in isr:
                    continue
                rest = [x for x in nodes if x not in isr]
                for k in range(len(rest) + 1):
                    states.append(PartitionState(leader=leader, isr=isr,
                                                 catchup=tuple(rest[:k]), epoch=2))
    for s in states:
        for live in ({A, B, C}, {A, B}, {B, C}):
            for draining in (set(), {A}):
                v = view(live, {"t": (2, [s, s])})
                plan = next_move(v, draining, 0)
                if plan is not None:
                    p = v.topics["t"].partitions[plan.partition]
                    assert len(p.isr) >= 2 and not p.catchup and plan.to in live
                    assert plan.to not in draining
                plan, _ = drain_move(v, A, {A})
                if plan is not None:
                    assert plan.to in live and plan.to != A


def test_balance_flags():
    from nsqlookupd.options import from_args

    o = from_args(["--balance-window", "02:00-06:00", "--balance-tolerance", "2",
                   "--balance-interval", "500ms"], "v")
    assert (o.balance_window, o.balance_tolerance, o.balance_interval) == ("02:00-06:00", 2, 0.5)
    assert from_args([], "v").balance_window == ""  # off by default
    for bad in (["--balance-window", "25:00-26:00"], ["--balance-tolerance", "0"],
                ["--balance-interval", "soon"]):
        with pytest.raises(SystemExit) as e:
            from_args(bad, "v")
        assert e.value.code == 2


def test_a_dead_node_is_drained_once_its_partitions_have_live_leaders():
    nodes = {B, C, D}  # A is dead
    led_by_dead = PartitionState(leader=A, isr=(A, B, C), epoch=3)
    dropped = PartitionState(leader=B, isr=(B, C), catchup=(A,), epoch=4)
    still_in_isr = PartitionState(leader=C, isr=(C, A, B), epoch=2)
    v = view(nodes, {"t": (3, [led_by_dead, dropped, still_in_isr])})
    plan, stuck = drain_move(v, A, {A})
    assert stuck == ["t:0: ISR incomplete or leader not settled"]  # failover's first
    assert plan == Plan("replica", "t", 1, A, D)
    check_replica_move(v, "t", 1, A, D)
    check_replica_move(v, "t", 2, A, D)  # idle: the leader never dropped it


def test_outside_the_window_only_leaders_move_and_they_end_even():
    """replicas=False (the window closed): no data move, however skewed the replicas; the
    leaders of a restart's pile-up (every partition led by the first node up) even out,
    and nothing is moved back once even."""
    nodes = [A, B, C]
    v = view(set(nodes), {"t": (3, skewed(nodes, 8, 3, A))})
    moves = []
    while (plan := next_move(v, set(), 1, replicas=False)) is not None:
        assert plan.kind == "leader" and plan.frm == A
        moves.append(plan)
        v = apply(v, plan)
        assert len(moves) < 20
    _, led = counts(v, nodes)
    assert sorted(led.values()) == [2, 3, 3] and len(moves) == 5
    lopsided = view({A, B, C, D}, {"t": (2, [
        PartitionState(leader=n, isr=(n, m), epoch=1) for n, m in ((A, D), (B, D), (C, D),
                                                                   (D, A))])})
    held, led = counts(lopsided, [A, B, C, D])
    assert held == {A: 2, B: 1, C: 1, D: 4} and set(led.values()) == {1}
    assert next_move(lopsided, set(), 1, replicas=False) is None
    assert next_move(lopsided, set(), 1).kind == "replica"  # inside the window it moves


def test_a_node_not_settled_takes_no_leader():
    """`settled`: only nodes live long enough take leaders (a node restarting in a loop is
    not handed leaders it will lose again); the others wait their turn."""
    nodes = [A, B, C]
    v = view(set(nodes), {"t": (3, skewed(nodes, 6, 3, A))})
    assert next_move(v, set(), 1, replicas=False, settled={A}) is None
    plan = next_move(v, set(), 1, replicas=False, settled={A, C})
    assert plan.kind == "leader" and plan.to == C
    while plan is not None:
        assert plan.to == C
        v = apply(v, plan)
        plan = next_move(v, set(), 1, replicas=False, settled={A, C})
    _, led = counts(v, nodes)
    assert led == {A: 3, B: 0, C: 3}


def racked(nodes_racks: dict[str, str]):
    """A view's nodes with racks: `info` with the rack given."""
    def with_rack(v: ClusterView) -> ClusterView:
        nodes = {n: NodeInfo(id=n, tcp=n, http=i.http, rpc=i.rpc, hostname=i.hostname,
                             version=i.version, rack=nodes_racks[n]) for n, i in v.nodes.items()}
        return ClusterView(v.revision, nodes, v.lookupds, v.master, v.topics, v.problems)
    return with_rack


def test_replica_moves_keep_a_partitions_replicas_on_distinct_racks():
    """Two nodes on one host (rack "h1": A and D): the balancer evens the replicas without
    ever putting two of a partition on h1; a drain of B takes no replica to a node of a
    rack the partition holds already, and says why it is stuck."""
    rack = racked({A: "h1", D: "h1", B: "h2", C: "h3"})
    states = [PartitionState(leader=B, isr=(B, C), epoch=1)] * 3 + \
        [PartitionState(leader=A, isr=(A, B), epoch=1)] * 3
    v = rack(view({A, B, C, D}, {"t": (2, states)}))
    moves = 0
    while (plan := next_move(v, set(), 1)) is not None and moves < 40:
        v = rack(apply(v, plan))
        moves += 1
        for s in v.topics["t"].partitions.values():
            assert len({v.racks[n] for n in s.isr}) == len(s.isr), (plan, s)
    held, _ = counts(v, [A, B, C, D])
    assert max(held.values()) - min(held.values()) <= 1, held
    both = rack(view({A, B, C, D}, {"t": (2, [PartitionState(leader=A, isr=(A, B),
                                                             epoch=1)])}))
    plan, stuck = drain_move(both, B, set())
    assert plan == Plan("replica", "t", 0, B, C)  # D shares h1 with A
    lone = rack(view({A, B, D}, {"t": (2, [PartitionState(leader=A, isr=(A, B), epoch=1)])}))
    plan, stuck = drain_move(lone, B, set())
    assert plan is None and "rack" in stuck[0], stuck


def test_a_dead_node_on_the_same_host_drains_to_a_live_one():
    """A dead node is not in the view, so its rack is unknown: it is taken to be its host's
    (nsqd's default). Nodes of one host (./run.sh, the tests) drain and balance as before
    racks existed (a dead node's id taken as a rack of its own refused every move)."""
    live = ["127.0.0.1:4150", "127.0.0.1:4152", "127.0.0.1:4154"]
    dead = "127.0.0.1:4156"
    v = view(set(live), {"t": (2, [PartitionState(leader=live[0], isr=(live[0], dead),
                                                  epoch=3)])})
    plan, stuck = drain_move(v, dead, set())
    assert plan is not None and plan.kind == "replica" and plan.frm == dead, stuck


def test_a_node_that_registers_again_settles_again(monkeypatch):
    """Balancer.settled counts a node's live time under its current registration: a restart
    seen only as a new lease (between two polls, within the old lease's TTL) starts it over."""
    import nsqlookupd.balancer as balancer

    now = [1000.0]
    monkeypatch.setattr(balancer.time, "monotonic", lambda: now[0])
    b = balancer.Balancer(None, None, tolerance=1, interval=1.0, settle=10.0)
    v = view({A, B}, {})
    first = dataclasses.replace(v, registrations={A: 7, B: 8})
    assert b.settled(first) == set()
    now[0] += 10
    assert b.settled(first) == {A, B}
    restarted = dataclasses.replace(v, registrations={A: 7, B: 9})  # B's new lease
    assert b.settled(restarted) == {A}
    now[0] += 9.9
    assert b.settled(restarted) == {A}
    now[0] += 0.1
    assert b.settled(restarted) == {A, B}
