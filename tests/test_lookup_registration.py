"""Our nsqd registering with our nsqlookupd (classic mode, real processes): topics and
channels appear and go in /lookup and /nodes as they are made and deleted, and after a
restart of either side; publishing does not wait for a lookupd that is down."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from servers import NsqdProcess, NsqlookupdProcess


def get(address: str, path: str):
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def post(address: str, path: str, body: bytes = b"") -> int:
    req = urllib.request.Request(f"http://{address}{path}", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status


def until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def lookup(lookupd, topic):
    return get(lookupd.http_address, f"/lookup?topic={topic}")


def producers(lookupd, topic):
    status, doc = lookup(lookupd, topic)
    return [(p["broadcast_address"], p["tcp_port"], p["http_port"]) for p in doc["producers"]] \
        if status == 200 else None


@pytest.fixture
def cluster(tmp_path):
    lookupd = NsqlookupdProcess(str(tmp_path)).start()
    nsqd = NsqdProcess(str(tmp_path / "nsqd"), "--lookupd-tcp-address", lookupd.tcp_address)
    nsqd.start()
    yield lookupd, nsqd
    nsqd.kill()
    lookupd.kill()
    assert "Traceback" not in nsqd.log() + lookupd.log()


def test_topics_and_channels_follow_the_node(cluster):
    lookupd, nsqd = cluster
    me = ("127.0.0.1", nsqd.tcp_port, nsqd.http_port)
    until(lambda: get(lookupd.http_address, "/nodes")[1]["producers"], what="the node")
    [node] = get(lookupd.http_address, "/nodes")[1]["producers"]
    assert (node["broadcast_address"], node["tcp_port"], node["http_port"]) == me
    assert node["version"] == "1.3.0" and node["topics"] == []

    post(nsqd.http_address, "/pub?topic=reg_a", b"hello")
    until(lambda: producers(lookupd, "reg_a") == [me], what="reg_a registered")
    post(nsqd.http_address, "/channel/create?topic=reg_a&channel=c1")
    until(lambda: lookup(lookupd, "reg_a")[1]["channels"] == ["c1"], what="c1")
    post(nsqd.http_address, "/channel/delete?topic=reg_a&channel=c1")
    until(lambda: producers(lookupd, "reg_a") == [me], what="reg_a still produced")
    assert get(lookupd.http_address, "/nodes")[1]["producers"][0]["topics"] == ["reg_a"]

    post(nsqd.http_address, "/topic/delete?topic=reg_a")
    until(lambda: producers(lookupd, "reg_a") == [], what="reg_a unregistered")
    assert get(lookupd.http_address, "/nodes")[1]["producers"][0]["topics"] == []
    status, doc = get(nsqd.http_address, "/stats?format=json")
    [peer] = doc["lookupd"]
    assert peer["address"] == lookupd.tcp_address and peer["connected"]


def test_node_restart_registers_again(cluster):
    lookupd, nsqd = cluster
    post(nsqd.http_address, "/pub?topic=rs_t", b"x")
    post(nsqd.http_address, "/channel/create?topic=rs_t&channel=rs_c")
    until(lambda: lookup(lookupd, "rs_t")[1]["channels"] == ["rs_c"], what="registered")
    assert nsqd.stop() == 0
    until(lambda: producers(lookupd, "rs_t") == [], what="gone with the node")
    nsqd.start()
    until(lambda: producers(lookupd, "rs_t"), what="back after the restart")
    assert lookup(lookupd, "rs_t")[1]["channels"] == ["rs_c"]


def test_lookupd_restart_gets_everything_again(cluster):
    lookupd, nsqd = cluster
    post(nsqd.http_address, "/pub?topic=lr_t", b"x")
    post(nsqd.http_address, "/channel/create?topic=lr_t&channel=lr_c")
    post(nsqd.http_address, "/pub?topic=lr_u", b"x")
    until(lambda: producers(lookupd, "lr_u"), what="registered")
    lookupd.kill()
    # While the lookupd is down, publishing and creating do not wait for it.
    t0 = time.monotonic()
    for i in range(20):
        post(nsqd.http_address, f"/pub?topic=lr_new{i % 2}", b"x")
    assert time.monotonic() - t0 < 2
    lookupd.start()
    for topic in ("lr_t", "lr_u", "lr_new0", "lr_new1"):
        until(lambda: producers(lookupd, topic), timeout=20, what=f"{topic} registered again")
    assert lookup(lookupd, "lr_t")[1]["channels"] == ["lr_c"]


def test_every_lookupd_sees_a_subscribers_ephemeral_channel_come_and_go(tmp_path):
    import socket

    lookupds = [NsqlookupdProcess(str(tmp_path)).start() for _ in range(2)]
    nsqd = NsqdProcess(str(tmp_path / "nsqd"), *(f"-lookupd-tcp-address={l.tcp_address}"
                                                 for l in lookupds)).start()
    try:
        sub = socket.create_connection(("127.0.0.1", nsqd.tcp_port), timeout=5)
        sub.sendall(b"  V2SUB eph_t c#ephemeral\n")
        assert sub.recv(100).endswith(b"OK")
        for l in lookupds:
            until(lambda: lookup(l, "eph_t")[1]["channels"] == ["c#ephemeral"], what="channel")
            assert producers(l, "eph_t") == [("127.0.0.1", nsqd.tcp_port, nsqd.http_port)]
        sub.close()  # the ephemeral channel goes with its last client
        for l in lookupds:
            until(lambda: lookup(l, "eph_t")[1]["channels"] == [], what="channel gone")
            assert producers(l, "eph_t")  # the topic stays
    finally:
        nsqd.kill()
        for l in lookupds:
            l.kill()
