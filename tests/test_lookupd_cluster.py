"""nsqlookupd in cluster mode, as real processes against a real etcd (lease TTL 2 s).

Two nsqlookupd processes share one etcd. The nsqd nodes are simulated for the lookupd's
purposes the way an nsqd shows itself: a child process (tests/isr_holder.py) keeps the
node's NodeInfo under a real lease, so SIGKILL of that process is a node's death."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest

from etcdserver import EtcdProcess
from isr import keys
from isr.etcd import Etcd
from isr.metadata import Metadata
from isr.state import NodeInfo
from servers import ROOT, NsqlookupdProcess

HOLDER = os.path.join(ROOT, "tests", "isr_holder.py")
TTL = 2
CLUSTER = "nsq"


def http(lookupd, method: str, path: str, timeout: float = 5) -> tuple[int, dict | None]:
    req = urllib.request.Request(f"http://{lookupd.http_address}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
            return r.status, (json.loads(body) if body else None)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(lookupd, path: str):
    return http(lookupd, "GET", path)


def post(lookupd, path: str):
    return http(lookupd, "POST", path)


def until(cond, timeout: float, step: float = 0.02) -> float:
    """Seconds until cond() is true; AssertionError after `timeout`."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not true after {timeout} s")
        time.sleep(step)
    return time.monotonic() - start


def node_info(port: int) -> NodeInfo:
    return NodeInfo(id=f"127.0.0.1:{port}", tcp=f"127.0.0.1:{port}",
                    http=f"127.0.0.1:{port + 1}", rpc=f"127.0.0.1:{port + 2}",
                    hostname=f"node{port}", version="1.3.0")


class Node:
    """A simulated nsqd: its NodeInfo under a lease held by a child process."""

    def __init__(self, etcd: EtcdProcess, port: int):
        self.info = node_info(port)
        self.proc = subprocess.Popen(
            [sys.executable, HOLDER, "register", etcd.endpoint,
             keys.node(CLUSTER, self.info.id), self.info.encode().decode(), str(TTL)],
            stdout=subprocess.PIPE, cwd=ROOT)
        assert self.proc.stdout.readline() == b"ready\n"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class MadeAnswers:
    """What nsqd's GET /channel/made answers, served for simulated nodes: every partition
    made (a channel create on the master waits for each leader's answer)."""

    def __init__(self, nodes):
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({"partitions": list(range(1024))}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.servers = []
        for n in nodes:
            port = int(n.info.http.rsplit(":", 1)[1])
            server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def master_of(lookupds):
    """(master, the others), as the lookupds' /info say."""
    for lk in lookupds:
        if get(lk, "/info")[1]["cluster"]["is_master"]:
            return lk, [o for o in lookupds if o is not lk]
    raise AssertionError("no master")


def start_lookupd(base: str, etcd: EtcdProcess) -> NsqlookupdProcess:
    return NsqlookupdProcess(base, "--etcd-endpoints", etcd.endpoint, "--etcd-lease-ttl",
                             f"{TTL}s", "--log-format", "json").start()


def ready(lookupds, nodes: int) -> bool:
    infos = [get(lk, "/info")[1]["cluster"] for lk in lookupds]
    return (all(i["nodes"] == nodes and i["master"] is not None for i in infos)
            and sum(i["is_master"] for i in infos) == 1)


@pytest.fixture(scope="module")
def cluster(module_dir):
    base = str(module_dir)
    etcd = EtcdProcess(os.path.join(base, "etcd")).start()
    nodes = [Node(etcd, 41000 + 10 * i) for i in range(3)]
    made = MadeAnswers(nodes)
    lookupds = [start_lookupd(base, etcd) for _ in range(2)]
    try:
        until(lambda: ready(lookupds, 3), 10)
        yield etcd, lookupds, nodes, base
    finally:
        for p in (*lookupds, *nodes):
            p.kill()
        etcd.kill()
        made.close()


def read_states(etcd: EtcdProcess, topic: str):
    """The topic's partition states as etcd holds them (to check replicas)."""
    async def read():
        client = Etcd(etcd.endpoint, timeout=2)
        try:
            return (await Metadata(client, CLUSTER).read()).topics[topic].partitions
        finally:
            await client.close()
    return asyncio.run(read())


def test_topics_of_1_4_16_partitions_spread_over_3_nodes(cluster):
    etcd, lookupds, nodes, _ = cluster
    master, others = master_of(lookupds)
    ids = sorted(n.info.id for n in nodes)
    leaders_total, held_total = Counter(), Counter()
    for n, replicas in ((1, 1), (4, 2), (16, 3)):
        topic = f"spread{n}"
        assert post(master, f"/topic/create?topic={topic}&partition_num={n}"
                            f"&replicator={replicas}") == (200, None)
        for lk in lookupds:  # both answer at once: the write waited for the master's view
            status, body = (until(lambda: get(lk, f"/lookup?topic={topic}")[0] == 200, 3)
                            and get(lk, f"/lookup?topic={topic}"))
            assert status == 200
            assert body["meta"] == {"partition_num": n, "replica": replicas,
                                    "ordered": False, "extend_support": False}
            assert sorted(body["partitions"]) == sorted(str(p) for p in range(n))
            leaders = [p["remote_address"] for p in body["partitions"].values()]
            assert sorted(p["remote_address"] for p in body["producers"]) == sorted(set(leaders))
            assert set(leaders) <= set(ids)
        states = read_states(etcd, topic)
        for p, state in states.items():  # exactly one leader, first of distinct replicas
            assert state.leader == body["partitions"][str(p)]["remote_address"]
            assert len(set(state.isr)) == replicas and state.leader in state.isr
            held_total.update(state.isr)
        leaders_total.update(leaders)
        # spread: counting every topic so far (placement counts existing load)
        assert max(leaders_total[i] for i in ids) - min(leaders_total[i] for i in ids) <= 1
        assert max(held_total[i] for i in ids) - min(held_total[i] for i in ids) <= 1
    assert sum(leaders_total.values()) == 21
    # /nodes: each live node with the partitions it leads
    status, body = get(others[0], "/nodes")
    led = {p["remote_address"]: len(p["partitions"]) for p in body["producers"]}
    assert led == {i: leaders_total[i] for i in ids}
    topics = get(others[0], "/topics")[1]["topics"]
    assert {"spread1", "spread4", "spread16"} <= set(topics)


@pytest.mark.parametrize("query, code", [
    ("topic=big&partition_num=2&replicator=4", "INVALID_ARG_REPLICATOR"),  # > live nodes
    ("topic=big&partition_num=2&replicator=6", "INVALID_ARG_REPLICATOR"),
    ("topic=big&partition_num=2&replicator=0", "INVALID_ARG_REPLICATOR"),
    ("topic=big&partition_num=0", "INVALID_ARG_PARTITION_NUM"),
    ("topic=big&partition_num=2000", "INVALID_ARG_PARTITION_NUM"),
    ("topic=big&partition_num=-1", "INVALID_ARG_PARTITION_NUM"),
    ("topic=big&partitions=x", "INVALID_ARG_PARTITION_NUM"),
    ("topic=bad%2Fname", "INVALID_ARG_TOPIC"),
    ("topic=bad+name", "INVALID_ARG_TOPIC"),
    ("topic=" + "x" * 65, "INVALID_ARG_TOPIC"),
    ("topic=", "INVALID_ARG_TOPIC"),  # as Go: present but empty
    ("partition_num=2", "MISSING_ARG_TOPIC"),
    ("topic=big&syncdisk=0", "INVALID_ARG_SYNCDISK"),
    ("topic=big&retention=forever", "INVALID_ARG_RETENTION"),
    ("topic=big&orderedmulti=maybe", "INVALID_ARG_ORDERED"),
])
def test_bad_topic_create_is_a_400_and_writes_nothing(cluster, query, code):
    _, lookupds, _, _ = cluster
    master, _ = master_of(lookupds)
    status, body = post(master, f"/topic/create?{query}")
    assert (status, body["message"]) == (400, code)
    assert "big" not in get(master, "/topics")[1]["topics"]


def test_bad_reads_and_existing_topics(cluster):
    _, lookupds, _, _ = cluster
    master, others = master_of(lookupds)
    assert get(others[0], "/lookup?topic=never") == (404, {"message": "TOPIC_NOT_FOUND"})
    assert get(others[0], "/lookup") == (400, {"message": "MISSING_ARG_TOPIC"})
    assert post(master, "/topic/create?topic=again&partition_num=3&retention=2"
                        "&orderedmulti=true&syncdisk=100") == (200, None)
    assert get(master, "/lookup?topic=again&access=x")[1]["message"] == "INVALID_ARG_ACCESS"
    r = get(others[0], "/lookup?topic=again&access=r")[1]
    assert r == get(others[0], "/lookup?topic=again&access=w")[1]
    assert r["meta"]["ordered"] is True and r["meta"]["partition_num"] == 3
    # the same create again is a no-op; other settings are a conflict
    assert post(master, "/topic/create?topic=again&partitions=3&retention=48h&ordered=1"
                        "&sync_every=100") == (200, None)
    status, body = post(master, "/topic/create?topic=again&partition_num=4")
    assert (status, body["message"]) == (409, "TOPIC_EXISTS")
    assert "partition_num 3" in body["detail"]


def test_writes_on_a_non_master_name_the_master(cluster):
    _, lookupds, _, _ = cluster
    master, others = master_of(lookupds)
    expected = (503, {"message": "NOT_MASTER", "master_http_address": master.http_address})
    for path in ("/topic/create?topic=nm", "/topic/delete?topic=nm",
                 "/channel/create?topic=nm&channel=c", "/channel/delete?topic=nm&channel=c"):
        assert post(others[0], path) == expected
    # the channel lifecycle through the master shows on every lookupd
    assert post(master, "/topic/create?topic=nm&partition_num=2") == (200, None)
    assert post(master, "/channel/create?topic=nm&channel=c1") == (200, None)
    assert post(master, "/channel/create?topic=never&channel=c1") == (
        404, {"message": "TOPIC_NOT_FOUND"})
    until(lambda: get(others[0], "/channels?topic=nm")[1] == {"channels": ["c1"]}, 3)
    assert get(others[0], "/lookup?topic=nm")[1]["channels"] == ["c1"]
    assert post(master, "/channel/delete?topic=nm&channel=c1") == (200, None)
    assert post(master, "/channel/delete?topic=nm&channel=c1") == (
        404, {"message": "CHANNEL_NOT_FOUND"})
    assert post(master, "/topic/delete?topic=nm") == (200, None)
    until(lambda: get(others[0], "/lookup?topic=nm")[0] == 404, 3)
    listing = get(others[0], "/listlookup")[1]
    assert sorted(n["ID"] for n in listing["lookupdnodes"]) == sorted(
        f"127.0.0.1:{lk.tcp_port}" for lk in lookupds)
    assert listing["lookupdleader"]["HttpPort"] == str(master.http_port)


def test_a_dead_node_makes_its_partitions_leaderless_within_the_ttl(cluster):
    etcd, lookupds, nodes, _ = cluster
    master, others = master_of(lookupds)
    extra = Node(etcd, 42000)
    try:
        until(lambda: all(get(lk, "/info")[1]["cluster"]["nodes"] == 4 for lk in lookupds), 5)
        # placement counts the load the others carry: the new, empty node gets them all
        assert post(master, "/topic/create?topic=doomed&partition_num=6") == (200, None)
        body = get(others[0], "/lookup?topic=doomed")[1]
        assert {p["remote_address"] for p in body["partitions"].values()} == {extra.info.id}
        assert post(master, "/topic/create?topic=mixed&partition_num=40") == (200, None)
        body = get(others[0], "/lookup?topic=mixed")[1]
        lost = sorted(p for p, prod in body["partitions"].items()
                      if prod["remote_address"] == extra.info.id)
        assert 0 < len(lost) < 40
        extra.kill()
        killed = time.monotonic()
        for lk in lookupds:
            until(lambda: get(lk, "/lookup?topic=doomed")[1]["partitions"] == {}, TTL + 2)
        took = time.monotonic() - killed
        assert took <= TTL + 1.5  # the lease expires at most TTL after its last refresh
        assert get(others[0], "/lookup?topic=doomed")[1]["producers"] == []
        body = get(others[0], "/lookup?topic=mixed")[1]
        assert sorted(body["partitions"]) == sorted(set(map(str, range(40))) - set(lost))
        assert extra.info.id not in [p["remote_address"] for p in body["producers"]]
        assert len(body["producers"]) == 3
        leaderless = get(others[0], "/info")[1]["cluster"]["leaderless"]
        assert sorted(x for x in leaderless if not x.startswith("doomed:")) == sorted(
            f"mixed:{p}" for p in lost)
        assert sorted(x for x in leaderless if x.startswith("doomed:")) == sorted(
            f"doomed:{p}" for p in range(6))
        assert extra.info.id not in [p["remote_address"]
                                     for p in get(master, "/nodes")[1]["producers"]]
        print(f"node lease expired -> leaderless on both lookupds in {took:.2f} s")
        assert post(master, "/topic/delete?topic=doomed") == (200, None)
        assert post(master, "/topic/delete?topic=mixed") == (200, None)
    finally:
        extra.kill()


def test_a_malformed_key_is_reported_never_a_crash(cluster):
    etcd, lookupds, _, _ = cluster
    import base64

    def put(key: str, value: bytes) -> None:
        etcd.post("kv/put", {"key": base64.b64encode(key.encode()).decode(),
                             "value": base64.b64encode(value).decode()})

    put(f"/nsq/{CLUSTER}/topics/garbled/meta", b"{not json")
    put(f"/nsq/{CLUSTER}/nodes/127.0.0.1:43000", b'{"id": 5}')
    for lk in lookupds:
        until(lambda: len(get(lk, "/info")[1]["cluster"]["problems"]) >= 2, 3)
        problems = get(lk, "/info")[1]["cluster"]["problems"]
        assert any("topics/garbled/meta" in p and "not JSON" in p for p in problems)
        assert any("nodes/127.0.0.1:43000" in p for p in problems)
        assert get(lk, "/lookup?topic=garbled") == (404, {"message": "TOPIC_NOT_FOUND"})
        assert get(lk, "/lookup?topic=spread4")[0] == 200  # still serving
        assert urllib.request.urlopen(f"http://{lk.http_address}/ping").read() == b"OK"
    etcd.post("kv/deleterange", {"key": base64.b64encode(
        f"/nsq/{CLUSTER}/topics/garbled/meta".encode()).decode()})
    etcd.post("kv/deleterange", {"key": base64.b64encode(
        f"/nsq/{CLUSTER}/nodes/127.0.0.1:43000".encode()).decode()})


def test_kill_9_of_the_master_lookupd(cluster):
    """The other takes over within the TTL; /lookup on it never stops answering."""
    etcd, lookupds, _, base = cluster
    master, others = master_of(lookupds)
    survivor = others[0]
    assert post(master, "/topic/create?topic=takeover&partition_num=4") == (200, None)
    until(lambda: get(survivor, "/lookup?topic=takeover")[0] == 200, 3)
    expected = get(survivor, "/lookup?topic=takeover")[1]
    answers, stop = [], threading.Event()

    def hammer():
        while not stop.is_set():
            try:
                status, body = get(survivor, "/lookup?topic=takeover")
                answers.append((time.monotonic(), status == 200 and body == expected))
            except OSError:
                answers.append((time.monotonic(), False))
            time.sleep(0.005)

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        try:
            master.kill()
            killed = time.monotonic()
            took = until(lambda: get(survivor, "/info")[1]["cluster"]["is_master"], TTL + 3)
            assert took <= TTL + 1.0, took
            # the new master takes writes at once
            assert post(survivor, "/topic/create?topic=after&partition_num=2") == (200, None)
            time.sleep(0.2)
        finally:
            stop.set()
            thread.join()
        during = [ok for t, ok in answers if t >= killed]
        assert len(during) > 20 and all(during), f"{during.count(False)} failed lookups"
        gaps = [b[0] - a[0] for a, b in zip(answers, answers[1:])]
        assert max(gaps) < 0.5  # never a stall
        print(f"takeover {took:.2f} s, {len(during)} lookups during it, longest gap "
              f"{max(gaps) * 1000:.0f} ms")
    finally:  # back whatever failed above: the module's later tests use every lookupd
        master.start()
    # the killed one comes back as a non-master, and names the new master
    until(lambda: get(master, "/info")[1]["cluster"]["master"] is not None, 5)
    status, body = post(master, "/topic/create?topic=x")
    assert (status, body) == (503, {"message": "NOT_MASTER",
                                    "master_http_address": survivor.http_address})


def test_etcd_killed_reads_go_on_from_the_last_view(etcd_server, tmp_path):
    lookupd = start_lookupd(str(tmp_path), etcd_server)
    node = Node(etcd_server, 44000)
    try:
        until(lambda: ready([lookupd], 1), 10)
        assert post(lookupd, "/topic/create?topic=kept&partition_num=4") == (200, None)
        before = get(lookupd, "/lookup?topic=kept")
        etcd_server.kill()
        down = time.monotonic()
        failed = 0
        while time.monotonic() - down < 4:  # longer than the TTL
            status, body = get(lookupd, "/lookup?topic=kept")
            failed += (status, body) != before
            time.sleep(0.05)
        assert failed == 0
        info = get(lookupd, "/info")[1]["cluster"]
        assert info["etcd_connected"] is False and "etcd unreachable" in info["view"]
        status, body = post(lookupd, "/topic/create?topic=during")
        assert status == 503 and body["message"] in ("NOT_MASTER",
                                                     "CLUSTER_METADATA_UNAVAILABLE")
        etcd_server.start()  # same ports, same data
        until(lambda: get(lookupd, "/info")[1]["cluster"]["is_master"], 10)
        until(lambda: post(lookupd, "/topic/create?topic=during")[0] == 200, 5)
        assert get(lookupd, "/info")[1]["cluster"]["etcd_connected"] is True
        assert get(lookupd, "/lookup?topic=during")[0] == 200
        assert get(lookupd, "/lookup?topic=kept") == before
    finally:
        node.kill()
        lookupd.kill()


def test_v1_registration_is_refused_in_cluster_mode(cluster):
    import socket

    from nsqwire import lookupd as v1

    _, lookupds, _, _ = cluster
    body = json.dumps({"broadcast_address": "h", "tcp_port": 1, "http_port": 2,
                       "version": "1.3.0"}).encode()
    with socket.create_connection(("127.0.0.1", lookupds[0].tcp_port), timeout=5) as s:
        s.sendall(v1.MAGIC_V1 + b"IDENTIFY\n" + len(body).to_bytes(4, "big") + body)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data[4:].startswith(b"E_INVALID cluster mode")


async def test_too_few_nodes_is_etcds_answer_not_a_lagging_views(etcd_server):
    """The master refuses `replicas > live nodes` only when etcd says so. Its view can lag
    etcd (a watch that reopens replays what it missed): a node registered just before a
    create must count. A jepsen run's first create was once refused with 0 live nodes
    while all 3 were registered."""
    from isr.state import TopicMeta
    from jepsen.ports import free_port
    from nsqlookupd.cluster import Cluster
    from nsqlookupd.http import HTTPError
    from nsqlookupd.options import Options

    cluster = Cluster(Options(etcd_endpoints=etcd_server.endpoint, cluster_id=CLUSTER,
                              etcd_lease_ttl=TTL), "test")
    await cluster.start("127.0.0.1", free_port(), free_port())
    node = None
    try:
        deadline = time.monotonic() + 10
        while not (cluster.is_master and cluster._current_view() is not None):
            assert time.monotonic() < deadline, "a master with a view"
            await asyncio.sleep(0.05)
        held, catch_up = [], cluster.mirror.on_change
        cluster.mirror.on_change = held.append  # the master's view stops here, with no node
        node = Node(etcd_server, free_port())
        creating = asyncio.create_task(cluster.create_topic("lagged", TopicMeta(partitions=2)))
        while not any("lagged" in v.topics for v in held):  # written on etcd's word
            if creating.done():
                creating.result()  # the refusal, if that is what it was
            assert time.monotonic() < deadline + 10, "the topic written"
            await asyncio.sleep(0.02)
        assert not cluster.directory.view.nodes  # the view still lags
        catch_up(held[-1])
        assert await creating is True
        with pytest.raises(HTTPError) as refused:  # etcd itself has one node
            await cluster.create_topic("wide", TopicMeta(partitions=1, replicas=2, min_isr=1))
        assert (refused.value.status, refused.value.code) == (400, "INVALID_ARG_REPLICATOR")
    finally:
        if node is not None:
            node.kill()
        await cluster.close()
