"""nsqadmin's /api/ without a browser, against real processes: one module-scoped cluster
(etcd, nsqlookupd, 3 nsqd) and a classic pair (nsqlookupd without etcd, one nsqd), with
four nsqadmin processes: open on the cluster, logins for actions on the cluster, logins
for everything on the single nsqd (--nsqd-http-address), open on the classic lookupd.

Every /api/ endpoint, each action and its effect as the nodes report it (a channel's dead
letters with a raw consumer that REQs; half messages committed and rolled back), bad input
(400, 403, 404 with a JSON body), login refusal, the 404 page and the bad-time message."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

from admin_env import (PASSWORD, Classic, Client, NsqadminProcess, RawConsumer,
                       ThreadConsumer, password_file, post_nsqd, publish, publish_half,
                       until)
from cluster import Cluster, http_json, wait_until
from servers import free_port


@pytest.fixture(scope="module")
def env(module_dir):
    root = str(module_dir)
    c = Cluster(root + "/c", 3, 1, "--msg-timeout", "60s")
    classic = Classic(root + "/classic")
    admins = []
    try:
        c.start()
        classic.start()
        wait_until(lambda: c.master() is not None, 15, "a master nsqlookupd (cluster writes)")
        lookupd = c.lookupds[0].http_address
        pw = password_file(root)
        admins = [
            NsqadminProcess(f"{root}/open.log", "--lookupd-http-address", lookupd),
            NsqadminProcess(f"{root}/login.log", "--lookupd-http-address", lookupd,
                            "--admin-user", "ops", "--admin-password-file", pw),
            NsqadminProcess(f"{root}/private.log", "--nsqd-http-address",
                            classic.nsqd.http_address, "--admin-user", "ops",
                            "--admin-password-file", pw, "--require-login-for-reads"),
            NsqadminProcess(f"{root}/classic.log", "--lookupd-http-address",
                            classic.lookupd.http_address)]
        for a in admins:
            a.start()
        yield {"cluster": c, "classic": classic, "open": admins[0], "login": admins[1],
               "private": admins[2], "classic_admin": admins[3]}
    finally:
        for a in admins:
            a.stop()
        classic.stop()
        c.stop()


def leader_of(c: Cluster, topic: str, partition: int = 0):
    return c.nsqd_at(wait_until(lambda: c.leaders(topic).get(partition), 15, "a leader"))


def test_reads_cluster(env):
    c, api = env["cluster"], Client(env["open"].url)
    # a 503 (the lookupd's etcd watch reopening) is retried, as a client does
    until(lambda: c.create_topic("reads", 2, replicas=2)[0] == 200, 10, "topic created")
    until(lambda: http_json("POST", f"http://{c.lookupds[0].http_address}/channel/create"
                                    "?topic=reads&channel=ch")[0] == 200, 10, "channel created")
    leader = leader_of(c, "reads")
    assert publish(leader.http_address, "/pub?topic=reads&partition=0", b"hello") == 200

    def topic_ready():
        s, v, _ = api.get("/api/topics/reads")
        return s == 200 and len(v["partitions"]) == 2 and "ch" in \
            [ch["name"] for ch in v["channels"]] and v["messages"] >= 1 and v
    v = until(topic_ready, 15, "the topic with both partitions, its channel and a message")
    p0 = next(p for p in v["partitions"] if p["number"] == 0)
    assert p0["leader"] == leader.http_address and len(p0["isr"]) == 2
    assert p0["epoch"] >= 1 and p0["writable"] is True and p0["messages"] == 1
    assert p0["depth"] == 1 and v["replication_note"] == "" and v["mode"] == "cluster"
    assert all(h for h in p0["isr_http"])  # each ISR member named by its HTTP address

    status, cl, headers = api.get("/api/cluster")
    assert status == 200 and cl["mode"] == "cluster" and len(cl["nodes"]) == 3
    assert cl["etcd"]["healthy"] and cl["lookupds"][0]["is_master"] is True
    assert all(n["health"] == "OK" and n["node_id"] for n in cl["nodes"])
    assert cl["load_available"] or cl["load_note"].startswith("load reports not available")
    assert headers["Server-Timing"].startswith("render;dur=")

    status, ts, _ = api.get("/api/topics")
    row = next(t for t in ts["topics"] if t["name"] == "reads")
    assert status == 200 and row["partitions"] == 2 and row["channels"] == 1

    status, ch, _ = api.get("/api/topics/reads/ch")
    assert status == 200 and ch["depth"] == 1 and ch["ordered"] is False
    assert {p["partition"] for p in ch["partitions"]} == {0, 1}
    for key in ("in_flight", "deferred", "delayed", "requeued", "timed_out", "clients"):
        assert key in ch

    status, node, _ = api.get(f"/api/nodes/{leader.http_address}")
    assert status == 200 and ("reads", 0) in {(p["topic"], p["number"]) for p in node["led"]}
    assert node["tombstone_note"].startswith("tombstones do not exist in cluster mode")

    for path, code in (("/api/topics/nope", "TOPIC_NOT_FOUND"),
                       ("/api/topics/reads/nope", "CHANNEL_NOT_FOUND"),
                       ("/api/nodes/10.0.0.1:1", "NODE_NOT_FOUND"),
                       ("/api/nothing", "NOT_FOUND")):
        status, body, _ = api.get(path)
        assert (status, body["message"]) == (404, code), path


def test_actions_cluster(env):
    c, api = env["cluster"], Client(env["open"].url)
    status, out, _ = api.post("/api/topics", {"topic": "acts", "partitions": 1, "replicas": 2})
    assert status == 200 and out["ok"], out
    status, v, _ = api.get("/api/topics/acts")  # the action waited until it shows
    assert status == 200 and len(v["partitions"]) == 1
    # its ISR shows once the leader's replication runs (a moment after the partition opens)
    until(lambda: len(api.get("/api/topics/acts")[1]["partitions"][0]["isr"]) == 2, 10,
          "the ISR of 2")
    status, out, _ = api.post("/api/topics/acts/channel_create", {"channel": "work"})
    assert status == 200 and out["ok"], out
    leader = leader_of(c, "acts")
    for i in range(3):
        assert publish(leader.http_address, "/pub?topic=acts", b"m%d" % i) == 200

    def channel(field):
        return api.get("/api/topics/acts/work")[1][field]

    until(lambda: channel("depth") == 3, 10, "depth 3")

    def node_paused():
        stats = http_json("GET", f"http://{leader.http_address}/stats?format=json"
                                 "&topic=acts")[1]
        return stats["topics"][0]["channels"][0]["paused"]

    assert api.post("/api/topics/acts/work/pause")[0] == 200
    assert channel("paused") is True and node_paused() is True
    assert api.post("/api/topics/acts/work/unpause")[0] == 200
    assert channel("paused") is False and node_paused() is False

    assert api.post("/api/topics/acts/work/empty")[0] == 200
    assert channel("depth") == 0
    status, out, _ = api.post("/api/topics/acts/work/setoffset", {"time": "-1h"})
    assert status == 200 and out["ok"], out  # replay from an hour ago: all three again
    until(lambda: channel("depth") == 3, 10, "depth back to 3 after the replay")

    assert api.post("/api/topics/acts/pause")[0] == 200
    assert api.get("/api/topics/acts")[1]["paused"] is True
    assert api.post("/api/topics/acts/unpause")[0] == 200
    assert api.post("/api/topics/acts/trace_on")[0] == 200
    assert api.get("/api/topics/acts")[1]["traced"] is True
    assert api.post("/api/topics/acts/trace_off")[0] == 200
    assert api.get("/api/topics/acts")[1]["traced"] is False
    assert api.post("/api/topics/acts/work/trace_on")[0] == 200
    assert channel("traced") is True

    status, out, _ = api.post("/api/topics/acts/tombstone", {"node": leader.http_address})
    assert (status, out["message"]) == (400, "TOMBSTONE_NOT_SUPPORTED")

    assert api.post("/api/topics/acts/work/delete")[0] == 200
    assert api.get("/api/topics/acts/work")[0] == 404
    assert api.post("/api/topics/acts/delete")[0] == 200
    assert api.get("/api/topics/acts")[0] == 404
    assert "acts" not in http_json("GET", f"http://{c.lookupds[0].http_address}/topics")[1][
        "topics"]


def test_trace_search_api(env):
    c, api = env["cluster"], Client(env["open"].url)
    assert api.post("/api/topics", {"topic": "traced", "partitions": 1})[0] == 200
    assert api.post("/api/topics/traced/channel_create", {"channel": "ch"})[0] == 200
    assert api.post("/api/topics/traced/trace_on")[0] == 200
    leader = leader_of(c, "traced")
    for n in c.nsqds:  # every node follows the switch through etcd
        until(lambda: "traced" in http_json("GET", f"http://{n.http_address}/stats?format="
                                                   "json")[1]["trace"]["topics"], 10,
              "the switch followed")
    since = time.time() - 1
    consumer = ThreadConsumer(leader.tcp_address, "traced", "ch").start()
    try:
        assert publish(leader.http_address, "/pub?topic=traced", b"find me") == 200
        assert publish(leader.http_address, "/pub?topic=traced", b"\x00\x01\xffbin") == 200
        assert consumer.take(10) and consumer.take(10)  # delivered and finished
    finally:
        consumer.stop()

    def found():  # each message's timeline: published, delivered, finished
        s, v, _ = api.get(f"/api/trace?topic=traced&since={since:.3f}")
        return s == 200 and len(v["messages"]) == 2 and all(
            len(m["events"]) == 3 for m in v["messages"]) and v
    v = until(found, 15, "both messages' timelines found by topic and window",
              detail=lambda: api.get(f"/api/trace?topic=traced&since={since:.3f}")[1])
    text, binary = v["messages"]
    assert text["body_text"] == "find me" and text["body_hex"] is None
    assert binary["body_text"] is None and binary["body_hex"] == "00 01 ff 62 69 6e"
    assert [e["kind"] for e in text["events"]] == ["PUB", "DELIVER", "FIN"]
    assert text["finished"] and text["story"].endswith("finished on ch")

    status, one, _ = api.get(f"/api/trace?msg_id={text['msg_id']}")
    assert status == 200 and [m["msg_id"] for m in one["messages"]] == [text["msg_id"]]
    status, one, _ = api.get("/api/trace?topic=traced&since=-5m&until=now")
    assert status == 200 and len(one["messages"]) == 2

    status, msg, _ = api.get(f"/api/message?topic=traced&msg_id={binary['msg_id']}")
    assert status == 200 and base64.b64decode(msg["body"]) == b"\x00\x01\xffbin"

    status, body, _ = api.get("/api/trace?msg_id=00000000000fffff")
    assert status == 404 and body["message"] == "MSG_NOT_FOUND"
    for query, words in (("topic=traced&since=yesterday", "bad since 'yesterday'"),
                         ("msg_id=xyz", "bad message id"), ("trace_id=abc", "bad trace id"),
                         ("topic=traced&since=now&until=-1h", "ends before it starts"),
                         ("channel=x", "give a message id")):
        status, body, _ = api.get(f"/api/trace?{query}")
        assert status == 400 and body["message"] == "BAD_QUERY" and words in body["detail"], \
            (query, body)


def test_dead_letters(env):
    """A channel's dead letters through nsqadmin: max_attempts set on every partition, two
    messages REQed once (one per partition) listed page by page across their leaders, one
    shown, requeued (delivered again), buried again, then purged one and all."""
    from nsqwire import commands

    c, api = env["cluster"], Client(env["open"].url)
    assert api.post("/api/topics", {"topic": "dead", "partitions": 2, "replicas": 2})[0] == 200
    assert api.post("/api/topics/dead/channel_create", {"channel": "ch"})[0] == 200
    leaders = wait_until(lambda: len(c.leaders("dead")) == 2 and c.leaders("dead"), 15,
                         "two leaders")
    until(lambda: len(api.get("/api/topics/dead/ch")[1]["partitions"]) == 2, 10,
          "both partitions of the channel shown")
    for args, code in (({"max_attempts": "70000"}, "INVALID_MAX_ATTEMPTS"),
                       ({}, "MISSING_ARG")):
        status, out, _ = api.post("/api/topics/dead/ch/max_attempts", args)
        assert (status, out["message"]) == (400, code), out
    status, out, _ = api.post("/api/topics/dead/ch/max_attempts", {"max_attempts": 1})
    assert status == 200 and out["ok"], out
    ch = api.get("/api/topics/dead/ch")[1]
    assert ch["max_attempts"] == 1 and [p["max_attempts"] for p in ch["partitions"]] == [1, 1]
    status, out, _ = api.post("/api/topics/dead/ch/dead_purge", {"id": "xyz"})
    assert (status, out["message"]) == (400, "INVALID_ID")

    consumers = {tcp: RawConsumer(tcp, "dead", "ch") for tcp in set(leaders.values())}
    try:
        for n, tcp in leaders.items():
            assert publish(c.nsqd_at(tcp).http_address, f"/pub?topic=dead&partition={n}",
                           b"<poison %d>" % n) == 200
        for tcp, consumer in consumers.items():
            for _ in [n for n in leaders if leaders[n] == tcp]:
                attempts, msg_id, body = consumer.take()
                assert attempts == 1 and body.startswith(b"<poison")
                consumer.send(commands.cmd_req(msg_id, 0, "why"))

        def listed(query=""):
            status, v, _ = api.get(f"/api/topics/dead/ch/dead{query}")
            assert status == 200, v
            return v
        v = until(lambda: listed()["count"] == 2 and listed(), 10, "two dead letters listed",
                  detail=listed)
        assert [d["body"] for d in v["dead_letters"]] == ["<poison 0>", "<poison 1>"]
        assert all((d["cause"], d["error"], d["attempts"]) == ("req", "why", 1)
                   for d in v["dead_letters"])
        assert v["next"] is None and v["errors"] == [] and v["loading"] == []
        until(lambda: api.get("/api/topics/dead/ch")[1]["dead"] == 2, 10, "dead: 2 in stats")

        first = listed("?limit=1")
        assert [d["partition"] for d in first["dead_letters"]] == [0] and first["count"] == 2
        second = listed(f"?limit=1&after={first['next']}")
        assert [d["partition"] for d in second["dead_letters"]] == [1]
        assert second["next"] is None
        status, body, _ = api.get("/api/topics/dead/ch/dead?after=nope")
        assert (status, body["message"]) == (400, "BAD_QUERY")

        letter = v["dead_letters"][0]
        status, one, _ = api.get(f"/api/topics/dead/ch/dead/{letter['id']}")
        assert status == 200 and one["body"] == "<poison 0>" and one["ext"] is None
        assert one["message_id"] == letter["message_id"] and one["node"] == letter["node"]
        status, body, _ = api.get("/api/topics/dead/ch/dead/0000000000000fff")
        assert (status, body["message"]) == (404, "DEAD_LETTER_NOT_FOUND")
        status, page, _ = api.get("/topics/dead/ch/dead")
        assert status == 200 and "&lt;poison 0&gt;" in page and "<poison" not in page
        assert f'href="/topics/dead/ch/dead/{letter["id"]}"' in page
        status, page, _ = api.get(f"/topics/dead/ch/dead/{letter['id']}")
        assert status == 200 and '<pre class="body text">&lt;poison 0&gt;</pre>' in page

        status, out, _ = api.post("/api/topics/dead/ch/dead_requeue", {"id": letter["id"]})
        assert status == 200 and out["ok"], out
        again = consumers[leaders[0]]
        attempts, msg_id, body = again.take()  # a fresh message: its first attempt
        assert (attempts, body) == (1, b"<poison 0>")
        assert [d["partition"] for d in listed()["dead_letters"]] == [1]
        again.send(commands.cmd_req(msg_id, 0, "still no"))
        v = until(lambda: listed()["count"] == 2 and listed(), 10, "buried again")
        reburied = next(d for d in v["dead_letters"] if d["partition"] == 0)
        assert reburied["id"] != letter["id"] and reburied["error"] == "still no"

        status, out, _ = api.post("/api/topics/dead/ch/dead_purge", {"id": reburied["id"]})
        assert status == 200 and out["ok"], out
        assert [d["partition"] for d in listed()["dead_letters"]] == [1]
        status, out, _ = api.post("/api/topics/dead/ch/dead_purge")
        assert status == 200 and out["ok"], out
        assert listed()["count"] == 0 and api.get("/api/topics/dead/ch")[1]["dead"] == 0
        for consumer in consumers.values():  # purged: never delivered again
            with pytest.raises(TimeoutError):
                consumer.take(0.5)
    finally:
        for consumer in consumers.values():
            consumer.close()


def test_half_messages(env):
    """Half messages through nsqadmin: one waiting on each of two partitions, counted from
    /stats on the topic page and listed from their leaders' /half; one committed (a
    consumer gets it), one rolled back (never delivered); wrong ids refused before any node
    is asked, a decision against the other refused by the node; actions need a login where
    nsqadmin asks for one; a classic nsqd's half committed the same way."""
    c, api = env["cluster"], Client(env["open"].url)
    assert api.post("/api/topics", {"topic": "halves", "partitions": 2,
                                    "replicas": 2})[0] == 200
    assert api.post("/api/topics/halves/channel_create", {"channel": "ch"})[0] == 200
    leaders = wait_until(lambda: len(c.leaders("halves")) == 2 and c.leaders("halves"), 15,
                         "two leaders")
    http = {n: c.nsqd_at(tcp).http_address for n, tcp in leaders.items()}
    ids = {n: publish_half(http[n], "halves", n, b"half %d" % n) for n in (0, 1)}
    assert [int(ids[n], 16) >> 50 for n in (0, 1)] == [0, 1]

    def topic():
        return api.get("/api/topics/halves")[1]
    until(lambda: topic()["half_waiting"] == 2, 10, "2 waiting in stats", detail=topic)
    assert [(p["number"], p["half_waiting"], p["half_committed"]) for p in
            topic()["partitions"]] == [(0, 1, 0), (1, 1, 0)]

    def listed():
        status, v, _ = api.get("/api/topics/halves/half")
        assert status == 200, v
        return v
    v = listed()
    assert v["count"] == 2 and v["errors"] == []
    assert [(w["partition"], w["id"], w["node"], w["check_url"]) for w in v["waiting"]] == [
        (n, ids[n], http[n], "http://127.0.0.1:9/never") for n in (0, 1)]
    assert all(abs(w["written_ms"] / 1000 - time.time()) < 60 for w in v["waiting"])
    assert [(p["partition"], p["node"], p["waiting"], p["committed"]) for p in
            v["partitions"]] == [(0, http[0], 1, 0), (1, http[1], 1, 0)]
    status, page, _ = api.get("/topics/halves")
    assert status == 200 and '<a href="/topics/halves/half">2 waiting</a>' in page
    status, page, _ = api.get("/topics/halves/half")
    assert status == 200 and "2 half messages waiting" in page and ids[1] in page
    assert 'action="/topics/halves/half_commit"' in page
    status, body, _ = api.get("/api/topics/nope/half")
    assert (status, body["message"]) == (404, "TOPIC_NOT_FOUND")

    for args, want in (({"id": "xyz"}, (400, "INVALID_ID")), ({}, (400, "MISSING_ARG")),
                       ({"id": f"{7 << 50:016x}"}, (404, "PARTITION_NOT_FOUND"))):
        status, out, _ = api.post("/api/topics/halves/half_commit", args)
        assert (status, out["message"]) == want, out
    status, out, _ = api.post("/api/topics/halves/half_commit", {"id": "0000000000000fff"})
    assert status == 502 and [(x["node"], x["status"], x["answer"]) for x in out["calls"]] \
        == [(http[0], 404, "HALF_NOT_FOUND")], out
    guarded = Client(env["login"].url)
    status, out, _ = guarded.post("/api/topics/halves/half_commit", {"id": ids[0]})
    assert (status, out["message"]) == (401, "LOGIN_REQUIRED")

    consumer = ThreadConsumer(leaders[0], "halves", "ch").start()
    try:
        assert consumer.take(0.5) is None  # a half is delivered by no channel
        status, out, _ = api.post("/api/topics/halves/half_commit", {"id": ids[0]})
        assert status == 200 and out["ok"] and out["action"] == \
            f"topic half_commit halves {ids[0]}", out
        assert [(x["node"], x["path"]) for x in out["calls"]] == [(http[0], "/half/commit")]
        assert consumer.take(10)[1] == b"half 0"
        status, out, _ = api.post("/api/topics/halves/half_rollback", {"id": ids[1]})
        assert status == 200 and out["ok"], out
        status, out, _ = api.post("/api/topics/halves/half_commit", {"id": ids[1]})
        assert status == 502 and out["calls"][0]["answer"] == "HALF_DECIDED", out
        v = listed()
        assert v["count"] == 0 and v["waiting"] == []
        assert [(p["committed"], p["rolled_back"]) for p in v["partitions"]] == [(1, 0), (0, 1)]
        t = topic()  # the action read the cluster again: the counts show at once
        assert (t["half_waiting"], t["half_committed"], t["half_rolled_back"],
                t["half_expired"]) == (0, 1, 1, 0)
        assert consumer.take(1) is None  # the rolled back half: never delivered
    finally:
        consumer.stop()

    classic, capi = env["classic"], Client(env["classic_admin"].url)
    assert post_nsqd(classic.nsqd.http_address, "/topic/create?topic=halfclassic") == 200
    half_id = publish_half(classic.nsqd.http_address, "halfclassic", 0, b"classic half")
    until(lambda: capi.get("/api/topics/halfclassic")[1].get("half_waiting") == 1, 10,
          "the classic half in stats")
    [w] = capi.get("/api/topics/halfclassic/half")[1]["waiting"]
    assert (w["id"], w["node"]) == (half_id, classic.nsqd.http_address)
    status, out, _ = capi.post("/api/topics/halfclassic/half_commit", {"id": half_id})
    assert status == 200 and out["ok"], out
    assert capi.get("/api/topics/halfclassic/half")[1]["partitions"][0]["committed"] == 1


def test_bad_input(env):
    api = Client(env["open"].url)
    status, body, _ = api.post("/api/topics/reads/pause", csrf=False)
    assert (status, body["message"]) == (403, "BAD_CSRF_TOKEN")
    status, body, _ = api.post("/api/topics/reads/pause",
                               headers={"X-CSRF-Token": "forged-token-of-a-page-elsewhere"})
    assert (status, body["message"]) == (403, "BAD_CSRF_TOKEN")
    for path, body_in, code in (
            ("/api/topics", {"topic": "bad name!"}, "INVALID_TOPIC"),
            ("/api/topics", {"topic": "x", "partitions": "0"}, "INVALID_PARTITIONS"),
            ("/api/topics", {"topic": "x", "replicas": "9"}, "INVALID_REPLICAS"),
            ("/api/topics", b"not json", "BAD_JSON"),
            ("/api/topics/reads/ch/setoffset", {"time": "soon"}, "INVALID_TIME"),
            ("/api/topics/reads/channel_create", {"channel": "a b"}, "INVALID_CHANNEL")):
        status, body, _ = api.post(path, body_in)
        assert (status, body["message"]) == (400, code), (path, body)
    status, body, _ = api.post("/api/topics/reads/explode")
    assert (status, body["message"]) == (404, "UNKNOWN_ACTION")
    status, body, _ = api.post("/api/topics/nope/pause")
    assert (status, body["message"]) == (404, "TOPIC_NOT_FOUND")
    status, body, _ = api.post("/api/topics/reads/nope/empty")
    assert (status, body["message"]) == (404, "CHANNEL_NOT_FOUND")
    status, body, _ = api.post("/api/login", {"user": "ops", "password": "x"})
    assert (status, body["message"]) == (400, "LOGIN_NOT_ENABLED")

    status, page, _ = api.get("/topics/nope")  # the HTML 404 page
    assert status == 404 and "TOPIC_NOT_FOUND" in page and "no topic &#x27;nope&#x27;" in page
    status, page, _ = api.get("/trace?topic=reads&since=tomorrow-ish")
    assert status == 400 and "bad since &#x27;tomorrow-ish&#x27;" in page
    assert "unix seconds" in page


def test_logins(env):
    api = Client(env["login"].url)
    assert api.get("/api/topics")[0] == 200  # reads stay open
    status, body, _ = api.post("/api/topics/reads/pause")
    assert (status, body["message"]) == (401, "LOGIN_REQUIRED")
    status, body, _ = api.post("/api/login", {"user": "ops", "password": "wrong"})
    assert (status, body["message"]) == (401, "BAD_LOGIN")
    status, body, _ = api.post("/api/login", {"user": "root", "password": PASSWORD})
    assert status == 401
    assert api.post("/api/login", {"user": "ops", "password": PASSWORD})[0] == 200
    assert api.post("/api/topics/reads/pause")[0] == 200
    assert api.post("/api/topics/reads/unpause")[0] == 200
    assert api.post("/api/logout")[0] == 200
    assert api.post("/api/topics/reads/pause")[0] == 401
    # an HTML form without a session goes to the login page
    status, page, _ = api.post("/topics/reads/pause", b"csrf=" + api.csrf.encode(),
                               headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200 and "Log in" in page  # followed the 303 to /login

    private = Client(env["private"].url)
    for path in ("/api/cluster", "/api/topics", "/api/trace?topic=x"):
        status, body, _ = private.get(path)
        assert (status, body["message"]) == (401, "LOGIN_REQUIRED"), path
    status, page, _ = private.get("/topics")
    assert status == 200 and 'action="/login"' in page  # redirected to the login form
    assert private.post("/api/login", {"user": "ops", "password": PASSWORD})[0] == 200
    status, cl, _ = private.get("/api/cluster")
    assert status == 200 and cl["mode"] == "nsqd" and len(cl["nodes"]) == 1


def test_single_nsqd_and_classic_lookupd(env):
    classic = env["classic"]
    private = Client(env["private"].url)
    assert private.post("/api/login", {"user": "ops", "password": PASSWORD})[0] == 200
    status, out, _ = private.post("/api/topics", {"topic": "solo", "partitions": 2})
    assert status == 200 and out["calls"][0]["node"] == classic.nsqd.http_address, out
    status, v, _ = private.get("/api/topics/solo")
    assert status == 200 and len(v["partitions"]) == 2
    assert v["partitions"][0]["isr"] == [] and v["partitions"][0]["epoch"] is None
    assert "no ISR, catch-up or epoch" in v["replication_note"]
    status, node, _ = private.get(f"/api/nodes/{classic.nsqd.http_address}")
    assert status == 200 and "need an nsqlookupd" in node["tombstone_note"]
    status, cl, _ = private.get("/api/cluster")
    assert cl["load_note"].startswith("load reports not available") and cl["etcd"] is None

    api = Client(env["classic_admin"].url)
    node = classic.nsqd.http_address
    until(lambda: "solo" in api.get(f"/api/nodes/{node}")[1].get("topics", []), 10,
          "the classic lookupd knows the nsqd's topic")
    status, cl, _ = api.get("/api/cluster")
    assert cl["mode"] == "classic" and cl["lookupds"][0]["is_master"] is None
    status, out, _ = api.post("/api/topics/solo/tombstone", {"node": node})
    assert status == 200 and out["ok"], out
    nodes = http_json("GET", f"http://{classic.lookupd.http_address}/nodes")[1]["producers"]
    assert dict(zip(nodes[0]["topics"], nodes[0]["tombstones"]))["solo"] is True
    assert api.get(f"/api/nodes/{node}")[1]["tombstones"]["solo"] is True
    status, body, _ = api.post("/api/topics/solo/tombstone", {"node": "10.1.1.1:4151"})
    assert (status, body["message"]) == (400, "INVALID_NODE")


# ---- pure parts: times typed by a person, bodies, the model's derived columns ----------

def test_times_and_bodies():
    from nsqadmin.times import BadTime, parse_time
    from nsqadmin.views import body_view
    now = 1_795_000_000.0
    assert parse_time("2026-11-26T10:00:00", now) == 1_795_687_200.0  # UTC without offset
    assert parse_time("2026-11-26T11:00:00+01:00", now) == 1_795_687_200.0
    assert parse_time("1795687200.5", now) == 1_795_687_200.5
    assert parse_time("-15m", now) == parse_time("15m ago", now) == now - 900
    assert parse_time("2h", now) == now - 7200 and parse_time("now", now) == now
    for bad in ("yesterday", "", "1795658400000", "2026-13-01", "-15x"):
        with pytest.raises(BadTime) as e:
            parse_time(bad, now, "since")
        assert "bad since" in str(e.value) and "unix seconds" in str(e.value)
    assert body_view({"body": "héllo\n\tworld", "body_encoding": "utf-8"})["body_text"] == \
        "héllo\n\tworld"
    nul = body_view({"body": "a\x00b", "body_encoding": "utf-8"})  # valid UTF-8, not printable
    assert nul["body_text"] is None and nul["body_hex"] == "61 00 62"
    raw = base64.b64encode(b"\xff\xfe").decode()
    assert body_view({"body": raw, "body_encoding": "base64"})["body_hex"] == "ff fe"


def test_model_catchup_depth_and_load():
    from nsqadmin import model

    def stats(node_id, leading, following, depth):
        topic = {"topic_name": "t", "partition_num": 1, "channels": [
            {"channel_name": "c", "message_count": 5, "clients": [], "partitions": [
                {"partition": 0, "depth": depth, "ordered": True}] if leading else []}],
            "partitions": [{"partition": 0, "leader": bool(leading), "committed_count": 9,
                            "start_count": 2}]}
        return {"topics": [topic], "cluster": {"node_id": node_id, "replication": {
            "leading": leading, "following": following}}}
    a, b, c = "10.0.0.1:4150", "10.0.0.2:4150", "10.0.0.3:4150"
    snap = model.build(
        "cluster", 1.0, [], [], ["t", "empty"],
        {"10.0.0.1:4151": stats(a, {"t/0": {"epoch": 4, "isr": [a, b]}}, {}, 7),
         "10.0.0.2:4151": stats(b, {}, {"t/0": {"epoch": 4}}, 0),
         "10.0.0.3:4151": stats(c, {}, {"t/0": {"epoch": 4}}, 0)}, {}, {},
        {"stable": True, "node_stat_list": [{"id": c, "broadcast_address": "10.0.0.3",
                                             "tcp_port": 4150, "http_port": 4151,
                                             "node_load_factor": 2.5}]}, "")
    [p] = snap.topics["t"].partitions
    assert (p.leader, p.isr, p.catchup, p.epoch) == ("10.0.0.1:4151", [a, b], [c], 4)
    assert p.messages == 9 and p.depth == 7 and snap.topics["t"].depth == 7  # committed
    assert snap.topics["t"].channels["c"].ordered is True
    assert snap.topics["empty"].partitions == []  # known to the lookupd only
    assert snap.nodes["10.0.0.3:4151"].load["node_load_factor"] == 2.5
    assert snap.nodes["10.0.0.1:4151"].load is None


def test_start_errors(tmp_path):
    """Bad flags exit 2 with argparse's line; an unreadable password file exits 1."""
    import subprocess
    import sys

    from servers import ROOT

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "nsqadmin", *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
        return r.returncode, r.stderr.strip().splitlines()[-1]
    code, line = run()
    assert code == 2 and "--lookupd-http-address or --nsqd-http-address required" in line
    code, line = run("--nsqd-http-address", "127.0.0.1:1", "--admin-user", "ops")
    assert code == 2 and "--admin-user needs --admin-password-file" in line
    code, line = run("--nsqd-http-address", "nonsense")
    assert code == 2 and "invalid address" in line
    code, line = run("--nsqd-http-address", "127.0.0.1:1", "--admin-user", "ops",
                     "--admin-password-file", str(tmp_path / "missing"))
    assert code == 1 and line.startswith("nsqadmin: cannot read --admin-password-file")


def test_cluster_moves_leader_drains_and_balances(env):
    """The balancing buttons (#13) through the API: a leader moved to the other ISR member,
    a node drained then its drain cancelled (the master's state shows in the node view),
    a balance step refused by a master without --balance-window (its refusal shown), and
    each refused outside cluster mode. Last in the module: the drain moves partitions."""
    c, api = env["cluster"], Client(env["open"].url)
    status, out, _ = api.post("/api/topics", {"topic": "moves", "partitions": 1,
                                              "replicas": 2})
    assert status == 200 and out["ok"], out
    p = until(lambda: (v := api.get("/api/topics/moves")[1]) and v["partitions"][0]["leader_id"]
              and len(v["partitions"][0]["isr"]) == 2 and v["partitions"][0], 15, "settled")
    to = next(i for i in p["isr"] if i != p["leader_id"])

    def moved():  # LEADER_NOT_SETTLED until the leader holds its key: asked again
        status, out, _ = api.post("/api/topics/moves/move_leader", {"partition": 0, "to": to})
        return status == 200 and out["ok"]
    until(moved, 15, "the leader moved")
    assert api.get("/api/topics/moves")[1]["partitions"][0]["leader_id"] == to
    html = api.get("/topics/moves")[1]
    assert 'action="/topics/moves/move_leader"' in html and 'name="to"' in html

    node = next(n for n in api.get("/api/cluster")[1]["nodes"] if n["node_id"] == to)
    status, out, _ = api.post(f"/api/nodes/{node['http']}/drain")
    assert status == 200 and out["ok"], out
    until(lambda: (api.get(f"/api/nodes/{node['http']}")[1]["load"] or {}).get("draining")
          or (api.get(f"/api/nodes/{node['http']}")[1]["load"] or {}).get("removable"),
          15, "the node shown draining")
    assert 'id="drain-state"' in api.get(f"/nodes/{node['http']}")[1]
    status, out, _ = api.post(f"/api/nodes/{node['http']}/drain_cancel")
    assert status == 200 and out["ok"], out
    status, out, _ = api.post(f"/api/nodes/{node['http']}/undrain")
    assert (status, out["message"]) == (404, "UNKNOWN_ACTION")

    status, out, _ = api.post("/api/cluster/balance")
    assert status == 502 and out["calls"][0]["answer"] == "BALANCER_OFF", out

    classic = Client(env["classic_admin"].url)
    nsqd = env["classic"].nsqd.http_address
    for path in (f"/api/nodes/{nsqd}/drain", "/api/cluster/balance"):
        status, out, _ = classic.post(path)
        assert (status, out["message"]) == (400, "NOT_A_CLUSTER"), path


def test_counts_survive_a_leader_move(env):
    """Issue 29: a channel's count fell after leader moves (the leader's own counter). Now
    the topic's `messages` is the log's committed count and the channel's
    `confirmed_count` its replicated cursor: both read the same from the new leader, and
    nothing published gives a rate of 0 through the move (no spike)."""
    c, api = env["cluster"], Client(env["open"].url)
    assert api.post("/api/topics", {"topic": "counted", "partitions": 1,
                                    "replicas": 2})[0] == 200
    assert api.post("/api/topics/counted/channel_create", {"channel": "ch"})[0] == 200
    p = until(lambda: (v := api.get("/api/topics/counted")[1]) and len(
        v["partitions"][0]["isr"]) == 2 and v["partitions"][0], 15, "the ISR of 2")
    leader = c.nsqd_at(p["leader_id"])
    consumer = ThreadConsumer(leader.tcp_address, "counted", "ch").start()
    try:
        for i in range(8):
            assert publish(leader.http_address, "/pub?topic=counted", b"a%d" % i) == 200
        assert all(consumer.take(10) for _ in range(8))
    finally:
        consumer.stop()
    for i in range(12):
        assert publish(leader.http_address, "/pub?topic=counted", b"b%d" % i) == 200

    def counts():
        t, ch = api.get("/api/topics/counted")[1], api.get("/api/topics/counted/ch")[1]
        return t["messages"], ch["confirmed_count"], t["partitions"][0]["leader_id"]
    until(lambda: counts()[:2] == (20, 8), 10, "20 messages, 8 confirmed", detail=counts)
    time.sleep(2)  # a checkpoint interval (1 s): the followers have the channel's cursor
    to = next(i for i in p["isr"] if i != p["leader_id"])
    until(lambda: api.post("/api/topics/counted/move_leader", {"partition": 0, "to": to})[0]
          == 200, 15, "the leader moved")
    until(lambda: counts() == (20, 8, to), 10, "the same counts from the new leader",
          detail=counts)
    deadline = time.monotonic() + 3  # six polls under the new leader: steady, no rate
    while time.monotonic() < deadline:
        t, ch = api.get("/api/topics/counted")[1], api.get("/api/topics/counted/ch")[1]
        assert (t["rate"], ch["rate"]) == (0, 0), (t["rates"], ch["rates"])
        if t["partitions"]:  # a poll may miss a node: then nothing is counted, never less
            assert t["messages"] == 20 and t["partitions"][0]["messages"] == 20, t
        if ch["partitions"]:
            assert ch["confirmed_count"] == 8, ch
        time.sleep(0.3)


def test_a_leader_change_between_polls_makes_no_spike():
    """Pure: a partition claimed by the old and the new leader in one poll is counted once
    (the higher epoch); one missing from a poll, or under a new leader, gives no rate from
    the jump of a total; a replay (the cursor moved back) gives 0, never a negative."""
    from nsqadmin import model
    from nsqadmin.history import History, channel_key, topic_key

    def stats(node_id, epoch, committed, confirmed):
        part = {"partition": 0, "leader": True, "committed_count": committed,
                "start_count": 40}
        chan = {"channel_name": "c", "message_count": committed - 90, "clients": [],
                "partitions": [{"partition": 0, "depth": committed - confirmed,
                                "confirmed_count": confirmed}]}
        return {"topics": [{"topic_name": "t", "partition_num": 1, "channels": [chan],
                            "partitions": [part]}],
                "cluster": {"node_id": node_id, "replication": {
                    "leading": {"t/0": {"epoch": epoch, "isr": ["a:1", "b:1"]}}}}}
    polls = [{"a": stats("a:1", 2, 100, 30)},
             {"a": stats("a:1", 2, 100, 30), "b": stats("b:1", 3, 100, 30)},  # both claim
             {},  # neither answered as leader
             {"b": stats("b:1", 3, 100, 30)},
             {"b": stats("b:1", 3, 110, 35)},  # 10 published, 5 confirmed in 1 s
             {"b": stats("b:1", 3, 110, 10)}]  # replayed from an earlier point
    hist = History(60, 1)
    seen = []
    for i, s in enumerate(polls):
        snap = model.build("cluster", float(i), [], [], ["t"], s, {}, {}, None, "")
        hist.add(snap)
        t = snap.topics["t"]
        seen.append((t.messages, t.channels["c"].confirmed_count if t.channels else None))
    assert seen == [(100, 30), (100, 30), (0, None), (100, 30), (110, 35), (110, 10)]
    # the series start afresh when b's claim is the only one: no spike from 0 to 100
    assert hist.rates(topic_key("t")) == [10.0, 0.0]
    assert hist.rates(channel_key("t", "c")) == [5.0, 0.0]


def test_version():
    import platform
    import subprocess
    import sys

    from servers import ROOT
    python = ".".join(platform.python_version_tuple()[:2])
    for flag in ("--version", "-version"):
        r = subprocess.run([sys.executable, "-m", "nsqadmin", flag], cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
        assert (r.returncode, r.stdout) == (
            0, f"nsqadmin v1.3.0 (durable-nsq 0.1.0, python {python})\n"), r.stderr


def test_favicon_and_plurals(env):
    from nsqadmin.pages import count, trace_page
    status, body, headers = Client(env["open"].url).get("/favicon.ico")
    assert status == 200 and headers["Content-Type"] == "image/svg+xml"
    assert body.startswith("<svg")
    assert [count(n, "message") for n in (0, 1, 2, 1234)] == [
        "0 messages", "1 message", "2 messages", "1,234 messages"]
    v = {"status": 200, "count": 1, "messages": [{"msg_id": "00", "events": []}],
         "nodes": ["n:1"], "unreachable": [], "query": {"topic": "t"}, "traced": True}
    _, html = trace_page(v, {}, "", {"csrf": "x"})
    assert "1 event, 1 message ·" in html and 'id="tracing-off"' not in html
    _, html = trace_page({**v, "count": 0, "messages": [], "traced": False}, {}, "",
                         {"csrf": "x"})
    assert "0 events, 0 messages" in html and 'action="/topics/t/trace_on"' in html


async def test_an_action_reads_the_cluster_again_when_no_lookupd_answered_the_last_poll():
    """An nsqadmin whose last poll reached no lookupd (just started on a loaded machine)
    does not act on that view (its mode and nodes unknown): it polls again first."""
    from types import SimpleNamespace

    from nsqadmin import actions

    class Source:
        polls = 0

        def __init__(self, lookupds):
            self.snapshot = SimpleNamespace(lookupds=lookupds)

        async def refresh(self):
            self.polls += 1
            return "read again"

    blind = Source([{"address": "a:4161", "error": "/info: no answer"},
                    {"address": "b:4161", "error": "/nodes: HTTP 500"}])
    assert await actions._snapshot(blind) == "read again" and blind.polls == 1
    seen = Source([{"address": "a:4161", "error": "/info: no answer"},
                   {"address": "b:4161", "error": ""}])
    assert await actions._snapshot(seen) is seen.snapshot and seen.polls == 0


async def test_every_request_has_an_end(monkeypatch):
    """Half a request line is closed once IDLE_S passes (aiohttp's own timer is an hour),
    and a POST whose body stops coming is 408 BODY_TIMEOUT once BODY_S passes (before, it
    waited for as long as the client stayed connected)."""
    from aiohttp import web

    from nsqadmin import app as admin_app
    from nsqadmin import auth
    from nsqadmin.options import from_args
    from nsqadmin.source import Source
    from nsqwire import httpapi

    monkeypatch.setattr(httpapi, "IDLE_S", 0.5)
    monkeypatch.setattr(httpapi, "BODY_S", 0.5)
    options = from_args(["--lookupd-http-address", f"127.0.0.1:{free_port()}"], "test")
    runner = admin_app.make_runner(admin_app.make_app(Source(options), auth.Auth({}, False),
                                                      2.0))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /pi")
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /api/topics HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{")
        got = b""
        async with asyncio.timeout(5):
            while b"BODY_TIMEOUT" not in got:
                got += await reader.read(65536)
        writer.write(b"x" * 99)  # the rest, late: read and dropped
        async with asyncio.timeout(5):
            while await reader.read(65536):  # then closed, idle
                pass
        writer.close()
        assert got.startswith(b"HTTP/1.1 408 "), got
    finally:
        await runner.cleanup()
