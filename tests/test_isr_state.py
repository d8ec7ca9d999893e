"""isr/keys.py and isr/state.py: the key tree and the strict value codecs (no etcd)."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from isr import keys
from isr.metadata import build_view
from isr.etcd import KeyValue, parse_endpoints, prefix_end
from isr.state import (BadValue, ChannelMeta, LookupdInfo, NodeInfo, PartitionState,
                       TopicMeta)

node_ids = st.builds(lambda h, p: f"{h}:{p}", st.sampled_from(["127.0.0.1", "n1", "h.example"]),
                     st.integers(1, 65535))


def test_key_tree():
    assert keys.node("c1", "10.0.0.1:4150") == "/nsq/c1/nodes/10.0.0.1:4150"
    assert keys.lookupd("c1", "h:4160") == "/nsq/c1/lookupd/nodes/h:4160"
    assert keys.lookupd_master("c1") == "/nsq/c1/lookupd/master"
    assert keys.topic_meta("c1", "t.1") == "/nsq/c1/topics/t.1/meta"
    assert keys.channel("c1", "t", "ch#ephemeral") == "/nsq/c1/topics/t/channels/ch#ephemeral"
    assert keys.partition_state("c1", "t", 7) == "/nsq/c1/topics/t/p/7/state"
    assert keys.partition_leader("c1", "t", 7) == "/nsq/c1/topics/t/p/7/leader"
    assert keys.load("c1", "h:1") == "/nsq/c1/load/h:1"
    assert keys.parse_topic_key("c1", "/nsq/c1/topics/t/p/7/state") == ("t", "state", 7)
    assert keys.parse_topic_key("c1", "/nsq/c1/topics/t/meta") == ("t", "meta", None)
    assert keys.parse_topic_key("c1", "/nsq/c1/topics/t/channels/c") == ("t", "channel", "c")
    assert keys.parse_topic_key("c1", "/nsq/c1/topics/t/p/x/state") is None
    assert keys.parse_topic_key("c1", "/nsq/c2/topics/t/meta") is None


@pytest.mark.parametrize("call", [
    lambda: keys.node("c", "no-port"), lambda: keys.node("c", "a/b:1"),
    lambda: keys.node("c", "h:0"), lambda: keys.node("c", "h:70000"),
    lambda: keys.topic_meta("c", "a/b"), lambda: keys.topic_meta("c", ""),
    lambda: keys.topic_meta("c", "x" * 65), lambda: keys.channel("c", "t", "a b"),
    lambda: keys.partition_state("c", "t", -1), lambda: keys.partition_state("c", "t", 1024),
    lambda: keys.partition_state("c", "t", True), lambda: keys.cluster_prefix("a/b"),
    lambda: keys.cluster_prefix(""),
])
def test_bad_names(call):
    with pytest.raises(keys.BadName):
        call()


def test_prefix_end_and_endpoints():
    assert prefix_end("/nsq/c/") == "/nsq/c0"
    assert parse_endpoints("127.0.0.1:2379, http://h:1") == [("http", "127.0.0.1", 2379),
                                                             ("http", "h", 1)]
    for bad in ("", "ftp://h:1", "http://h:x", "http://h:1/path"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


states = st.builds(
    lambda isr, catchup, lead, epoch: PartitionState(
        isr[0] if lead else None, tuple(isr), tuple(c for c in catchup if c not in isr), epoch),
    st.lists(node_ids, min_size=1, max_size=5, unique=True),
    st.lists(node_ids, max_size=3, unique=True), st.booleans(), st.integers(0, 2**40))
metas = st.builds(lambda p, r, m, s, o, e, t, z: TopicMeta(p, r, min(m, r), s, 100, 0, o, e,
                                                          trace=t, paused=z),
                  st.integers(1, 1024), st.integers(1, 5), st.integers(1, 5),
                  st.integers(1, 10**6), st.booleans(), st.booleans(), st.booleans(),
                  st.booleans())


@given(states, metas, st.booleans(), st.integers(0, 2**50))
def test_round_trips(state, meta, ordered, created):
    assert PartitionState.decode(state.encode(), "k") == state
    assert PartitionState.decode(state.encode(), "k", revision=9).revision == 9
    assert TopicMeta.decode(meta.encode()) == meta
    ch = ChannelMeta(ordered, not ordered, created)
    assert ChannelMeta.decode(ch.encode()) == ch


def test_node_info():
    n = NodeInfo("10.0.0.1:4150", "10.0.0.1:4150", "10.0.0.1:4151", "10.0.0.1:4250", "h", "1.3.0")
    assert NodeInfo.decode(n.encode(), "k", "10.0.0.1:4150") == n
    with pytest.raises(BadValue, match="does not match its key"):
        NodeInfo.decode(n.encode(), "k", "10.0.0.2:4150")
    with pytest.raises(BadValue, match="not the tcp address"):
        NodeInfo("a:1", "b:1", "b:2", "b:3", "h", "v")
    lk = LookupdInfo("h:4160", "h:4160", "h:4161", "h", "1.3.0")
    assert LookupdInfo.decode(lk.encode()) == lk


def test_a_node_info_rack_defaults_to_its_host_also_for_an_older_writer():
    n = NodeInfo("10.0.0.1:4150", "10.0.0.1:4150", "10.0.0.1:4151", "10.0.0.1:4250", "h", "v")
    assert n.rack == "10.0.0.1" and b'"rack":"10.0.0.1"' in n.encode()
    older = json.loads(n.encode())
    del older["rack"]  # registered by an nsqd from before racks
    assert NodeInfo.decode(json.dumps(older).encode(), "k") == n
    racked = NodeInfo("10.0.0.1:4152", "10.0.0.1:4152", "10.0.0.1:4153", "10.0.0.1:4252", "h",
                      "v", rack="row-7")
    assert NodeInfo.decode(racked.encode()).rack == "row-7"
    with pytest.raises(BadValue, match="bad rack"):
        NodeInfo.decode(json.dumps({**older, "rack": 7}).encode(), "k")


GOOD_STATE = {"leader": "a:1", "isr": ["a:1", "b:1"], "catchup": [], "epoch": 3}


@pytest.mark.parametrize("raw, reason", [
    (b"", "not JSON"), (b"{", "not JSON"), (b"\xff\xfe", "not JSON"), (b"[]", "not a JSON object"),
    (b"null", "not a JSON object"), (b'{"leader": "a:1"}', "missing catchup, epoch, isr"),
    (json.dumps({**GOOD_STATE, "extra": 1}).encode(), "unknown field extra"),
    (json.dumps({**GOOD_STATE, "epoch": "3"}).encode(), "bad epoch"),
    (json.dumps({**GOOD_STATE, "epoch": True}).encode(), "bad epoch"),
    (json.dumps({**GOOD_STATE, "epoch": -1}).encode(), "bad epoch"),
    (json.dumps({**GOOD_STATE, "epoch": 1.5}).encode(), "bad epoch"),
    (json.dumps({**GOOD_STATE, "isr": ["a:1", "a:1"]}).encode(), "bad isr"),
    (json.dumps({**GOOD_STATE, "isr": "a:1"}).encode(), "bad isr"),
    (json.dumps({**GOOD_STATE, "isr": ["a/1:2"]}).encode(), "bad isr"),
    (json.dumps({**GOOD_STATE, "leader": "c:1"}).encode(), "not in isr"),
    (json.dumps({**GOOD_STATE, "catchup": ["b:1"]}).encode(), "both in isr and catchup"),
    (b'{"leader": NaN, "isr": [], "catchup": [], "epoch": 1}', "not JSON"),
    (b"[" * 100000, "not JSON"),
])
def test_malformed_partition_state(raw, reason):
    with pytest.raises(BadValue, match=reason) as e:
        PartitionState.decode(raw, "/nsq/c/topics/t/p/0/state")
    assert e.value.key == "/nsq/c/topics/t/p/0/state"


@pytest.mark.parametrize("changes, reason", [
    ({"partitions": 0}, "bad partitions"), ({"partitions": 1025}, "bad partitions"),
    ({"replicas": 0}, "bad replicas"), ({"replicas": 6}, "bad replicas"),
    ({"min_isr": 3, "replicas": 2}, "min_isr 3 > replicas 2"),
    ({"sync_every": 0}, "bad sync_every"),
    ({"ordered": 1}, "bad ordered"), ({"retention_ms": -1}, "bad retention_ms"),
    ({"paused": "yes"}, "bad paused"),
])
def test_malformed_topic_meta(changes, reason):
    body = json.loads(TopicMeta(4).encode())
    body.update(changes)
    with pytest.raises(BadValue, match=reason):
        TopicMeta.decode(json.dumps(body).encode(), "meta")


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_bad_value(raw):
    for cls in (PartitionState, TopicMeta, ChannelMeta, NodeInfo, LookupdInfo):
        try:
            cls.decode(raw, "k")
        except BadValue:
            pass


def kv(key, value, rev=2):
    return KeyValue(key, value if isinstance(value, bytes) else value.encode(), rev)


def test_build_view_reports_problems():
    c = "c1"
    meta = TopicMeta(3, 2)
    state = PartitionState("a:1", ("a:1", "b:1"))
    node = NodeInfo("a:1", "a:1", "a:2", "a:3", "h", "v")
    kvs = [
        kv(keys.node(c, "a:1"), node.encode()),
        kv(keys.node(c, "b:1"), b"{garbage"),
        kv(keys.lookupd_master(c), "l:4160"),
        kv(keys.topic_meta(c, "t"), meta.encode()),
        kv(keys.partition_state(c, "t", 0), state.encode(), 7),
        kv(keys.partition_state(c, "t", 1), state.encode()[:10]),
        kv(keys.partition_state(c, "t", 5), state.encode()),
        kv(keys.partition_leader(c, "t", 0), "a:1"),
        kv(keys.channel(c, "t", "ch"), ChannelMeta().encode()),
        kv(keys.partition_state(c, "orphan", 0), state.encode()),
        kv(keys.topic_meta(c, "u"), b'{"partitions": 2000}'),
    ]
    view = build_view(c, kvs, 42)
    assert view.revision == 42 and view.master == "l:4160"
    assert list(view.nodes) == ["a:1"]
    t = view.topics["t"]
    assert t.meta == meta and list(t.partitions) == [0] and t.partitions[0].revision == 7
    assert t.leader_locks == {0: "a:1"} and list(t.channels) == ["ch"]
    assert set(view.topics) == {"t"}
    text = "\n".join(view.problems)
    assert "/nsq/c1/nodes/b:1: not JSON" in text
    assert "/nsq/c1/topics/t/p/1/state: not JSON" in text
    assert "partition 5 beyond the topic's 3" in text
    assert "no state for partitions [1, 2]" in text
    assert "orphan/: keys without a meta" in text
    assert "/nsq/c1/topics/u/meta: missing" in text
    assert view.leaderless() == []
    assert build_view(c, kvs[1:], 42).leaderless() == [("t", 0)]


def test_build_view_cache_decodes_only_changed_keys():
    c = "c1"
    state = PartitionState("a:1", ("a:1",))
    kvs = [kv(keys.topic_meta(c, "t"), TopicMeta(2).encode()),
           kv(keys.partition_state(c, "t", 0), state.encode(), 5),
           kv(keys.partition_state(c, "t", 1), b"bad", 5)]
    cache = {}
    assert build_view(c, kvs, 9, cache) == build_view(c, kvs, 9) == build_view(c, kvs, 9, cache)
    assert len(cache) == 3
    moved = state.evolve(leader=None, epoch=2)
    kvs[1] = kv(keys.partition_state(c, "t", 0), moved.encode(), 6)
    kvs[2] = kv(keys.partition_state(c, "t", 1), state.encode(), 6)
    view = build_view(c, kvs, 10, cache)
    assert view.topics["t"].partitions == {0: moved, 1: state} and not view.problems
    assert view.topics["t"].partitions[0].revision == 6
