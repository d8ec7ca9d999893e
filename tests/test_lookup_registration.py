"""Our nsqd registering with our nsqlookupd (classic mode, real processes): topics and
channels appear and go in /lookup and /nodes as they are made and deleted, and after a
restart or kill -9 of either side; publishing does not wait for a lookupd that is down,
frozen or broken."""

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


def channels(lookupd, topic):
    """The topic's channels in the lookupd's /lookup, or None while it does not know the topic
    (registration is asynchronous: a SUB is answered before the lookupd hears of it)."""
    status, doc = lookup(lookupd, topic)
    return doc["channels"] if status == 200 else None


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
    until(lambda: channels(lookupd, "reg_a") == ["c1"], what="c1")
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
    until(lambda: channels(lookupd, "rs_t") == ["rs_c"], what="registered")
    assert nsqd.stop() == 0
    until(lambda: producers(lookupd, "rs_t") == [], what="gone with the node")
    nsqd.start()
    until(lambda: producers(lookupd, "rs_t"), what="back after the restart")
    assert channels(lookupd, "rs_t") == ["rs_c"]


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
    assert channels(lookupd, "lr_t") == ["lr_c"]


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
            until(lambda: channels(l, "eph_t") == ["c#ephemeral"], what="channel")
            assert producers(l, "eph_t") == [("127.0.0.1", nsqd.tcp_port, nsqd.http_port)]
        sub.close()  # the ephemeral channel goes with its last client
        for l in lookupds:
            until(lambda: channels(l, "eph_t") == [], what="channel gone")
            assert producers(l, "eph_t")  # the topic stays
    finally:
        nsqd.kill()
        for l in lookupds:
            l.kill()


def test_a_node_killed_9_is_gone_from_the_lookupd_at_once(cluster):
    """kill -9: the node sends nothing, but its connection closes with it, and the
    lookupd drops everything the node registered (not after the inactivity timeout)."""
    lookupd, nsqd = cluster
    post(nsqd.http_address, "/pub?topic=k9_t", b"x")
    post(nsqd.http_address, "/channel/create?topic=k9_t&channel=k9_c")
    until(lambda: channels(lookupd, "k9_t") == ["k9_c"], what="registered")
    nsqd.kill()
    until(lambda: producers(lookupd, "k9_t") == [], timeout=2, what="the node's topic gone")
    assert get(lookupd.http_address, "/nodes")[1]["producers"] == []
    nsqd.start()
    until(lambda: producers(lookupd, "k9_t"), what="back after the restart")


class Publisher:
    """Publishes to the node over HTTP in a thread, recording each request's (start, end)
    and every failure."""

    def __init__(self, nsqd, topics: int = 10):
        import threading

        self.nsqd, self.topics = nsqd, topics
        self.times: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        i = 0
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                post(self.nsqd.http_address, f"/pub?topic=pb_{i % self.topics}", b"m")
            except OSError as e:
                self.errors.append(repr(e))
            self.times.append((t, time.monotonic()))
            i += 1

    def stop(self):
        self._stop.set()
        self._thread.join(10)


def test_publishing_never_waits_for_a_crashed_or_frozen_lookupd(cluster):
    """A lookupd killed -9 and restarted, then one frozen for 4 s (SIGSTOP: the connection
    stays open, nothing is answered; the node's answer timeout is 5 s, so its session
    waits), while the node publishes all along, new topics too: no publish fails,
    publishes complete while the lookupd is frozen, and afterwards the lookupd knows
    every topic again."""
    import signal

    lookupd, nsqd = cluster
    pub = Publisher(nsqd)
    try:
        until(lambda: len(get(lookupd.http_address, "/topics")[1]["topics"]) == 10,
              what="the topics")
        lookupd.kill()
        time.sleep(0.5)
        lookupd.start()
        until(lambda: len(get(lookupd.http_address, "/topics")[1]["topics"]) == 10,
              timeout=20, what="the topics again after kill -9")
        lookupd.proc.send_signal(signal.SIGSTOP)
        pub.topics = 20  # new topics are registered while the lookupd is frozen
        frozen = time.monotonic()
        try:
            time.sleep(4)
        finally:
            thawed = time.monotonic()
            lookupd.proc.send_signal(signal.SIGCONT)
        until(lambda: len(get(lookupd.http_address, "/topics")[1]["topics"]) == 20,
              timeout=20, what="the topics made while the lookupd was frozen")
    finally:
        pub.stop()
    assert pub.errors == []
    # a publish that waited for the frozen lookupd would end only after the thaw
    assert sum(1 for start, end in pub.times if frozen + 1 < start and end < thawed) >= 5
    assert max(end - start for start, end in pub.times) < 3


def fake_lookupd(answer: bytes):
    """A TCP server that answers whatever comes with `answer`, then holds the
    connection: what a broken or hostile lookupd does to the node."""
    import socket
    import threading

    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(65536)
            try:
                conn.sendall(answer)
            except OSError:
                pass
            threading.Timer(30, conn.close).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv


@pytest.mark.parametrize("answer, error", [
    (b"\x00\x00\x00\x03[1]", "IDENTIFY answered list, not a JSON object"),
    (b"\x7f\xff\xff\xff", "invalid lookupd response size 2147483647"),
    (b"\x00\x00\x00\x02{}" + b"\x00\x00\x00\x02OK" * 1000, "sent what was not asked for"),
    (b"\x00\x00\x00\x0eE_INVALID nope", "E_INVALID nope"),
])
def test_a_broken_lookupd_costs_the_node_nothing(tmp_path, answer, error):
    srv = fake_lookupd(answer)
    address = f"127.0.0.1:{srv.getsockname()[1]}"
    nsqd = NsqdProcess(str(tmp_path / "nsqd"), "--lookupd-tcp-address", address).start()
    try:
        for i in range(20):
            assert post(nsqd.http_address, f"/pub?topic=bl_{i}", b"x") == 200
        [peer] = until(lambda: [p for p in get(nsqd.http_address, "/stats?format=json")[1]
                                ["lookupd"] if error in p["last_error"]],
                       what=f"the node noticing {error!r}")
        assert peer["address"] == address
    finally:
        nsqd.kill()
        srv.close()
    assert "Traceback" not in nsqd.log()
