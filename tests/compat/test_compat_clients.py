"""Real NSQ client libraries against our real nsqd: pynsq 0.9.1 (tornado), gnsq 1.0.2
(gevent, in a subprocess), ansq 0.3.0 (asyncio), nsqjs 0.13.0 (node).

Every test runs one scenario through one client (see drivers.py) and asserts on
what the client really saw: bodies, counts, attempts and timings. Each test has
a timeout, so a hang fails instead of blocking.

Features a client does not have are left out of that test's client list, with
the reason next to the list (the test_ansq_* tests at the end check ansq's):
- ansq 0.3.0: no TLS, snappy or deflate (its upgrade methods raise
  NotImplementedError); it always sends msg_timeout in IDENTIFY (default
  60000), so a server-wide --msg-timeout never applies to it. Its AUTH works
  only without IDENTIFY (after a negotiated auth_required it refuses every
  command client-side), so drv_ansq authenticates bare connections.
- gnsq 1.0.2: IDENTIFY has no msg_timeout field (NsqdTCPClient takes none), so
  its timeout/touch scenarios use a server started with --msg-timeout 1s. Its
  Producer breaks on any upgrade (TLS/snappy/deflate: wtolson/gnsq#25), so
  those scenarios publish with gnsq's NsqdTCPClient; its Consumer upgrades.
- nsqjs 0.13.0: a Writer never reconnects; the crash scenario makes a new one.
- snappy/deflate/TLS (also TLS then snappy/deflate on one connection) are
  exercised with pynsq, gnsq and nsqjs.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from compat_util import (GOOD_SECRET, PUB_ONLY_SECRET, AuthServer, RawConn, unique,
                         wait_closed)
from drivers import DRIVERS

ALL = ["pynsq", "gnsq", "ansq", "nsqjs"]
COMPRESSING = ["pynsq", "gnsq", "nsqjs"]  # ansq 0.3.0: NotImplementedError for snappy/deflate
TLS = ["pynsq", "gnsq", "nsqjs"]  # ansq 0.3.0: NotImplementedError for TLS
IDENTIFY_MSG_TIMEOUT = ["pynsq", "ansq", "nsqjs"]  # gnsq 1.0.2 cannot send msg_timeout
FLAG_MSG_TIMEOUT = ["pynsq", "gnsq", "nsqjs"]  # ansq always sends msg_timeout (60 s default)

BODIES = [f"msg-{i}" for i in range(20)] + ["multi\nline body", "ünïcode ✓", "x" * 5000]
EPS = 0.02  # clock/timer granularity between the client's clock and the server's


def params(server, scenario: str, **kw) -> dict:
    p = {"scenario": scenario, "tcp": server.tcp_address, "topic": unique("t"),
         "channel": "ch", "conn": {}}
    p.update(kw)
    return p


def assert_exactly_once(received, bodies):
    got = collections.Counter(r[0] for r in received)
    want = collections.Counter(bodies)
    missing = want - got
    extra = got - want
    assert not missing and not extra, f"missing {list(missing)[:5]}, extra {list(extra)[:5]}"
    assert all(r[1] == 1 for r in received), [r for r in received if r[1] != 1][:5]


def assert_negotiated(r, **features):
    """Every connection (producer and consumer) negotiated these upgrades, so the
    data really went through them (a client silently falls back otherwise)."""
    responses = r["identify"]
    assert len(responses) >= 2, responses
    for resp in responses:
        for name, value in features.items():
            assert resp.get(name) == value, (name, resp)


async def run(client, p, **kw):
    return await DRIVERS[client].run(p, **kw)


# ---- publish and consume ---------------------------------------------------------


@pytest.mark.parametrize("client", ALL)
async def test_pub_consume(client, shared_nsqd):
    r = await run(client, params(shared_nsqd, "pubsub", mode="pub", bodies=BODIES))
    assert r["acks"] == ["OK"] * len(BODIES)
    assert_exactly_once(r["received"], BODIES)


@pytest.mark.parametrize("client", ALL)
async def test_pub_consume_four_partitions(client, shared_nsqd):
    """A topic of 4 partitions, all led by this node: the classic client's PUBs spread
    over them, its one SUB gets every message once (nsqd/assignment.py)."""
    import urllib.request

    p = params(shared_nsqd, "pubsub", mode="pub", bodies=BODIES)
    req = urllib.request.Request(f"http://{shared_nsqd.http_address}/topic/create?"
                                 f"topic={p['topic']}&partition_num=4", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
    r = await run(client, p)
    assert r["acks"] == ["OK"] * len(BODIES)
    assert_exactly_once(r["received"], BODIES)


@pytest.mark.parametrize("client", ALL)
async def test_mpub(client, shared_nsqd):
    r = await run(client, params(shared_nsqd, "pubsub", mode="mpub", bodies=BODIES))
    assert r["acks"] == ["OK"]
    assert_exactly_once(r["received"], BODIES)


@pytest.mark.parametrize("client", ALL)
async def test_dpub_arrives_no_earlier_than_defer(client, shared_nsqd):
    defer_ms = 1000
    r = await run(client, params(shared_nsqd, "dpub", defer_ms=defer_ms))
    assert r["acks"] == ["OK", "OK"]
    by_body = {body: (attempts, t) for body, attempts, t in r["received"]}
    assert sorted(b for b, _, _ in r["received"]) == ["later", "now"], r["received"]
    now_t, later_t = by_body["now"][1], by_body["later"][1]
    assert now_t < later_t
    assert later_t - r["t_send"] >= defer_ms / 1000 - EPS, r
    assert later_t - r["t_send"] < defer_ms / 1000 + 2.0, r
    assert by_body["later"][0] == 1


@pytest.mark.parametrize("client", ALL)
async def test_req_redelivers_with_attempts_incremented(client, shared_nsqd):
    req_ms = 300
    r = await run(client, params(shared_nsqd, "req", req_ms=req_ms))
    rec = r["received"]
    assert [(b, a) for b, a, _ in rec] == [("again", 1), ("again", 2)], rec
    assert rec[1][2] - rec[0][2] >= req_ms / 1000 - EPS, rec


@pytest.mark.parametrize("client", ALL)
async def test_touch_keeps_message_past_msg_timeout(client, shared_nsqd, short_timeout_nsqd):
    # msg_timeout 1 s (IDENTIFY, or the server flag for gnsq); the consumer holds
    # the message 2.5 s touching it every 300 ms, FINs it, and listens 1.5 s more.
    if client in IDENTIFY_MSG_TIMEOUT:
        p = params(shared_nsqd, "touch", conn={"msg_timeout_ms": 1000})
    else:
        p = params(short_timeout_nsqd, "touch")
    p.update(hold_ms=2500, touch_every_ms=300, linger_ms=1500)
    r = await run(client, p)
    assert [(b, a) for b, a, _ in r["received"]] == [("touched", 1)], r["received"]
    assert r["fin_t"] - r["received"][0][2] >= 2.4


def _assert_timed_out_once(r, timeout_s):
    rec = r["received"]
    assert [(b, a) for b, a, _ in rec] == [("slow", 1), ("slow", 2)], rec
    gap = rec[1][2] - rec[0][2]
    assert timeout_s - 0.1 <= gap <= timeout_s + 2.0, rec


@pytest.mark.parametrize("client", IDENTIFY_MSG_TIMEOUT)
async def test_msg_timeout_from_identify(client, shared_nsqd):
    r = await run(client, params(shared_nsqd, "timeout", conn={"msg_timeout_ms": 1000}))
    _assert_timed_out_once(r, 1.0)


@pytest.mark.parametrize("client", FLAG_MSG_TIMEOUT)
async def test_msg_timeout_from_server_flag(client, short_timeout_nsqd):
    r = await run(client, params(short_timeout_nsqd, "timeout"))
    _assert_timed_out_once(r, 1.0)


# ---- several consumers, several channels -----------------------------------------


@pytest.mark.parametrize("client", ALL)
async def test_consumers_share_a_channel(client, shared_nsqd):
    bodies = [f"s-{i}" for i in range(40)]
    r = await run(client, params(shared_nsqd, "multi_consumer", bodies=bodies))
    a, b = r["consumers"]
    assert sorted(a + b) == sorted(bodies), "each message exactly once across the consumers"
    assert a and b, f"both consumers must get some: {len(a)} / {len(b)}"


@pytest.mark.parametrize("client", ALL)
async def test_every_channel_gets_every_message(client, shared_nsqd):
    bodies = [f"c-{i}" for i in range(15)]
    r = await run(client, params(shared_nsqd, "multi_channel", bodies=bodies,
                                 channels=["ch_a", "ch_b"]))
    for name, got in r["channels"].items():
        assert sorted(got) == sorted(bodies), name


# ---- heartbeats ----------------------------------------------------------------


@pytest.mark.parametrize("client", ALL)
async def test_heartbeats_keep_idle_client_connected(client, shared_nsqd):
    r = await run(client, params(shared_nsqd, "heartbeat", conn={"heartbeat_ms": 1000},
                                 idle_s=3.5))
    assert r["heartbeats"] >= 2, r
    assert r["connects"] == 1, f"the connection was dropped and remade: {r}"
    assert [m[0] for m in r["received"]] == ["after-idle"], r


def test_missed_heartbeats_close_the_connection(shared_nsqd):
    conn = RawConn(shared_nsqd.tcp_address)
    try:
        conn.command("IDENTIFY", b'{"heartbeat_interval": 1000, "feature_negotiation": true}')
        kind, data = conn.frame()
        assert kind == 0 and b'"max_rdy_count"' in data, data
        closed_after, frames = wait_closed(conn, 8)
    finally:
        conn.close()
    assert b"_heartbeat_" in frames
    assert frames.count(b"_heartbeat_") == 2, frames  # as nsqd: two heartbeats, then the close
    assert 1.8 <= closed_after <= 2.8, f"closed {closed_after:.2f}s after IDENTIFY (interval 1s)"


# ---- compression, TLS ------------------------------------------------------------


COMPRESSIBLE = [("compressible " * 400) + str(i) for i in range(30)] + ["tiny", "z" * 70000]


@pytest.mark.parametrize("client", COMPRESSING)
@pytest.mark.parametrize("codec", ["snappy", "deflate"])
async def test_compression(client, codec, shared_nsqd):
    for mode in ("pub", "mpub"):
        r = await run(client, params(shared_nsqd, "pubsub", mode=mode, bodies=COMPRESSIBLE,
                                     conn={codec: True}))
        assert set(r["acks"]) == {"OK"}
        assert_exactly_once(r["received"], COMPRESSIBLE)
        assert_negotiated(r, **{codec: True})


@pytest.mark.parametrize("client", TLS)
async def test_tls(client, tls_nsqd, tls_files):
    r = await run(client, params(tls_nsqd, "pubsub", mode="pub", bodies=BODIES,
                                 conn={"tls": {"ca": tls_files[0]}}))
    assert r["acks"] == ["OK"] * len(BODIES)
    assert_exactly_once(r["received"], BODIES)
    assert_negotiated(r, tls_v1=True)


@pytest.mark.parametrize("client", TLS)
@pytest.mark.parametrize("codec", ["snappy", "deflate"])
async def test_tls_then_compression(client, codec, tls_nsqd, tls_files):
    r = await run(client, params(tls_nsqd, "pubsub", mode="mpub", bodies=COMPRESSIBLE,
                                  conn={"tls": {"ca": tls_files[0]}, codec: True}))
    assert r["acks"] == ["OK"]
    assert_exactly_once(r["received"], COMPRESSIBLE)
    assert_negotiated(r, tls_v1=True, **{codec: True})


# ---- AUTH ------------------------------------------------------------------------


@pytest.mark.parametrize("client", ALL)
async def test_auth(client, servers):
    async with AuthServer() as auth:
        nsqd = await asyncio.to_thread(servers.start, "--auth-http-address", auth.address)
        p = params(nsqd, "auth", mode="pub", bodies=BODIES[:5],
                   conn={"auth_secret": GOOD_SECRET}, bad_secret="wrong",
                   pub_only_secret=PUB_ONLY_SECRET)
        r = await run(client, p)
    assert r["acks"] == ["OK"] * 5
    assert_exactly_once(r["received"], BODIES[:5])
    assert any("E_AUTH_FAILED" in e for e in r["bad_secret_errors"]), r["bad_secret_errors"]
    assert r["pub_only_ack"] == "OK"
    assert any("E_UNAUTHORIZED" in e for e in r["pub_only_sub_errors"]), r["pub_only_sub_errors"]
    secrets = {q["secret"] for q in auth.requests}
    assert {GOOD_SECRET, "wrong", PUB_ONLY_SECRET} <= secrets
    assert all(q["remote_ip"] == "127.0.0.1" and q["tls"] == "false" for q in auth.requests)


# ---- crash and restart -----------------------------------------------------------


@pytest.mark.parametrize("client", ALL)
async def test_reconnect_after_crash_loses_no_acked_message(client, servers):
    nsqd = servers.start()
    n = 60
    state = {"at_kill": None}

    async def on_event(evt):
        # SIGKILL mid-stream, once a third is acknowledged (the slow consumer has
        # not taken them all yet), then restart on the same ports and data path.
        if evt.get("event") == "progress" and state["at_kill"] is None and evt["acked"] >= n // 3:
            state["at_kill"] = evt
            nsqd.kill()
            await asyncio.sleep(0.3)
            await asyncio.to_thread(nsqd.start)

    # pynsq's Reader waits a hard-coded 15 s before reconnecting.
    r = await run(client, params(nsqd, "reconnect", n=n, wait=45, consume_delay_ms=30),
                  on_event=on_event, timeout=90)
    assert state["at_kill"] is not None, "the server was never killed"
    assert state["at_kill"]["received"] < state["at_kill"]["acked"], state["at_kill"]
    acked = r["acked"]
    assert sorted(acked, key=lambda s: int(s[2:])) == [f"r-{i}" for i in range(n)]
    lost = set(acked) - set(r["received"])
    assert not lost, f"acknowledged messages lost: {sorted(lost)}"


# ---- what ansq 0.3.0 does not implement ------------------------------------------


@pytest.mark.parametrize("feature", ["tls_v1", "snappy", "deflate"])
async def test_ansq_lacks_tls_and_compression(feature, shared_nsqd, tls_nsqd):
    """ansq 0.3.0 negotiates these but raises NotImplementedError on upgrade; the
    other features are covered above."""
    import ansq
    from ansq.tcp.types import ConnectionFeatures

    server = tls_nsqd if feature == "tls_v1" else shared_nsqd  # the server must offer it
    host, port = server.tcp_address.split(":")
    conn = ansq.tcp.connection.NSQConnection(host, int(port), connection_options=ansq.ConnectionOptions(
        features=ConnectionFeatures(**{feature: True}), auto_reconnect=False))
    await conn.connect()
    try:
        with pytest.raises(NotImplementedError):
            await asyncio.wait_for(conn.identify(), 5)
    finally:
        conn._auto_reconnect = False
        await conn.close()


async def test_ansq_refuses_commands_after_negotiated_auth(servers):
    """ansq 0.3.0 bug, not ours: once IDENTIFY says auth_required, its connection
    refuses every command but AUTH client-side, even after a successful AUTH
    (`_is_authorized` is never set). drv_ansq's auth scenario avoids IDENTIFY."""
    import ansq
    from ansq.tcp.exceptions import NSQUnauthorized

    async with AuthServer() as auth:
        nsqd = await asyncio.to_thread(servers.start, "--auth-http-address", auth.address)
        host, port = nsqd.tcp_address.split(":")
        conn = await ansq.open_connection(host, int(port), connection_options=ansq.ConnectionOptions(
            auto_reconnect=False))
        try:
            assert conn.is_auth_required
            resp = await asyncio.wait_for(conn.auth(GOOD_SECRET), 5)
            assert resp.is_response and b'"permission_count":1' in resp.body.replace(b" ", b"")
            with pytest.raises(NSQUnauthorized):
                await asyncio.wait_for(conn.pub(unique("t"), b"x"), 5)
        finally:
            await conn.close()
