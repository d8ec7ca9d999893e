"""ansq 0.3.0 (asyncio) scenarios, run in-process.

Library facts these scenarios rely on (read from ansq's source):
- create_writer/create_reader connect and IDENTIFY; a Reader subscribes with RDY 1
  per connection; connections reconnect by themselves (auto_reconnect, after 1 s,
  then backing off 2, 4, ... s) and re-subscribe;
- IDENTIFY always carries msg_timeout (default 60000 ms);
- TLS, snappy and deflate upgrades raise NotImplementedError;
- AUTH: the Writer/Reader helpers never send AUTH, and a connection told
  `auth_required: true` by IDENTIFY refuses every later command client-side
  (its `_is_authorized` flag is never set); IDENTIFY with feature_negotiation
  off fails too (ansq compares the response object with b"OK" and then tries
  to parse "OK" as JSON). The auth scenario therefore opens NSQConnections,
  skips IDENTIFY (optional in the protocol) and calls NSQConnection.auth().
"""

from __future__ import annotations

import asyncio
import time

import ansq
from ansq.tcp.types import ConnectionFeatures


def options(opts: dict | None, **kw) -> ansq.ConnectionOptions:
    opts = opts or {}
    features = {}
    if opts.get("msg_timeout_ms"):
        features["msg_timeout"] = opts["msg_timeout_ms"]
    if opts.get("heartbeat_ms"):
        features["heartbeat_interval"] = opts["heartbeat_ms"]
    features.update(kw.pop("features", {}))
    return ansq.ConnectionOptions(features=ConnectionFeatures(**features), **kw)


class Ctx:
    def __init__(self, params: dict):
        self.p = params
        self.t0 = time.monotonic()
        self.clients: list = []
        self.tasks: list[asyncio.Task] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def writer(self, opts=None, **kw):
        w = await ansq.create_writer(nsqd_tcp_addresses=[self.p["tcp"]],
                                     connection_options=options(
                                         self.p.get("conn") if opts is None else opts, **kw))
        self.clients.append(w)
        return w

    async def reader(self, channel, opts=None, **kw):
        r = await ansq.create_reader(topic=self.p["topic"], channel=channel,
                                     nsqd_tcp_addresses=[self.p["tcp"]],
                                     connection_options=options(
                                         self.p.get("conn") if opts is None else opts, **kw))
        self.clients.append(r)
        return r

    def consume(self, reader, handler) -> None:
        """Run `await handler(message)` for every message of `reader` in a task."""
        async def loop():
            async for m in reader.messages():
                await handler(m)
        self.tasks.append(asyncio.get_running_loop().create_task(loop()))

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        for c in self.clients:
            for conn in getattr(c, "connections", (c,)):
                conn._auto_reconnect = False
            try:
                await asyncio.wait_for(c.close(), 5)
            except Exception:
                pass


async def until(cond, timeout: float, what: str, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(step)


def ok(resp) -> str:
    """The response text: "OK", or the error as ansq renders it ("[E_...] ...")."""
    return resp.text if resp is not None else "None"


def _s(b: bytes) -> str:
    return b.decode()


# ---- scenarios -----------------------------------------------------------------


async def pubsub(ctx: Ctx) -> dict:
    p = ctx.p
    bodies = p["bodies"]
    w = await ctx.writer()
    acks = []
    if p.get("mode") == "mpub":
        acks.append(ok(await w.mpub(p["topic"], *[b.encode() for b in bodies])))
    else:
        for b in bodies:
            acks.append(ok(await w.pub(p["topic"], b.encode())))
    received = []
    r = await ctx.reader(p["channel"])

    async def handler(m):
        received.append([_s(m.body), m.attempts])
        await m.fin()

    ctx.consume(r, handler)
    await until(lambda: len(received) >= len(bodies), 15, "all messages")
    await asyncio.sleep(0.3)
    return {"acks": acks, "received": list(received)}


async def dpub(ctx: Ctx) -> dict:
    p = ctx.p
    received = []
    r = await ctx.reader(p["channel"])

    async def handler(m):
        received.append([_s(m.body), m.attempts, ctx.now()])
        await m.fin()

    ctx.consume(r, handler)
    w = await ctx.writer()
    await asyncio.sleep(0.1)
    t_send = ctx.now()
    ack_later = ok(await w.dpub(p["topic"], b"later", p["defer_ms"]))
    ack_now = ok(await w.pub(p["topic"], b"now"))
    await until(lambda: len(received) >= 2, p["defer_ms"] / 1000 + 5, "deferred message")
    await asyncio.sleep(0.3)
    return {"acks": [ack_later, ack_now], "t_send": t_send, "received": received}


async def req(ctx: Ctx) -> dict:
    p = ctx.p
    received = []
    w = await ctx.writer()
    await w.pub(p["topic"], b"again")
    r = await ctx.reader(p["channel"])

    async def handler(m):
        received.append([_s(m.body), m.attempts, ctx.now()])
        if m.attempts == 1:
            await m.req(p["req_ms"])
        else:
            await m.fin()

    ctx.consume(r, handler)
    await until(lambda: len(received) >= 2, 10, "redelivery after REQ")
    await asyncio.sleep(0.5)
    return {"received": received}


async def touch(ctx: Ctx) -> dict:
    p = ctx.p
    received = []
    state = {}
    w = await ctx.writer()
    await w.pub(p["topic"], b"touched")
    r = await ctx.reader(p["channel"])

    async def hold(m):
        end = time.monotonic() + p["hold_ms"] / 1000
        while time.monotonic() < end:
            await asyncio.sleep(p["touch_every_ms"] / 1000)
            await m.touch()
        await m.fin()
        state["fin_t"] = ctx.now()

    async def handler(m):
        received.append([_s(m.body), m.attempts, ctx.now()])
        if m.attempts == 1:
            ctx.tasks.append(asyncio.get_running_loop().create_task(hold(m)))
        else:
            await m.fin()

    ctx.consume(r, handler)
    await until(lambda: "fin_t" in state, p["hold_ms"] / 1000 + 5, "FIN after touching")
    await asyncio.sleep(p["linger_ms"] / 1000)
    return {"received": received, "fin_t": state["fin_t"]}


async def timeout(ctx: Ctx) -> dict:
    p = ctx.p
    received = []
    w = await ctx.writer()
    await w.pub(p["topic"], b"slow")
    r = await ctx.reader(p["channel"])

    async def handler(m):
        received.append([_s(m.body), m.attempts, ctx.now()])
        if m.attempts > 1:
            await m.fin()  # the first delivery is never answered: it must time out

    ctx.consume(r, handler)
    await until(lambda: len(received) >= 2, 10, "redelivery after timeout")
    await asyncio.sleep(0.3)
    return {"received": received}


async def multi_consumer(ctx: Ctx) -> dict:
    p = ctx.p
    got: list[list[str]] = [[], []]
    readers = [await ctx.reader(p["channel"]) for _ in range(2)]

    def make(i):
        async def handler(m):
            got[i].append(_s(m.body))
            await asyncio.sleep(0.005)
            await m.fin()
        return handler

    for i, r in enumerate(readers):
        ctx.consume(r, make(i))
    w = await ctx.writer()
    await asyncio.sleep(0.1)
    for b in p["bodies"]:
        await w.pub(p["topic"], b.encode())
    await until(lambda: len(got[0]) + len(got[1]) >= len(p["bodies"]), 15, "all messages")
    await asyncio.sleep(0.5)
    return {"consumers": got}


async def multi_channel(ctx: Ctx) -> dict:
    p = ctx.p
    got = {c: [] for c in p["channels"]}
    for c in p["channels"]:
        r = await ctx.reader(c)

        def make(c):
            async def handler(m):
                got[c].append(_s(m.body))
                await m.fin()
            return handler
        ctx.consume(r, make(c))
    w = await ctx.writer()
    await asyncio.sleep(0.1)
    await w.mpub(p["topic"], *[b.encode() for b in p["bodies"]])
    await until(lambda: all(len(v) >= len(p["bodies"]) for v in got.values()), 15,
                "every channel's copy")
    await asyncio.sleep(0.3)
    return {"channels": got}


async def heartbeat(ctx: Ctx) -> dict:
    p = ctx.p
    received = []
    beats = []

    async def on_heartbeat(conn):
        beats.append(ctx.now())

    r = await ctx.reader(p["channel"], on_heartbeat=on_heartbeat)
    connects = [1]
    for conn in r.connections:  # count reconnects (NSQConnection.reconnect calls connect)
        orig = conn.connect

        async def counting(orig=orig):
            connects[0] += 1
            return await orig()
        conn.connect = counting

    async def handler(m):
        received.append([_s(m.body), m.attempts])
        await m.fin()

    ctx.consume(r, handler)
    await asyncio.sleep(p["idle_s"])
    heartbeats, before = len(beats), connects[0]
    w = await ctx.writer({})
    await w.pub(p["topic"], b"after-idle")
    await until(lambda: received, 5, "message after the idle period")
    return {"heartbeats": heartbeats, "connects": connects[0], "connects_before_pub": before,
            "received": received}


async def auth(ctx: Ctx) -> dict:
    p = ctx.p
    host, port = p["tcp"].split(":")
    async def connection(secret):
        # No IDENTIFY: see the module docstring.
        from ansq.tcp.connection import NSQConnection

        conn = NSQConnection(host, int(port),
                             connection_options=options({}, auto_reconnect=False))
        await conn.connect()
        ctx.clients.append(conn)
        return conn, await conn.auth(secret)

    pub, resp = await connection(p["conn"]["auth_secret"])
    if not resp:
        raise AssertionError(f"AUTH failed: {resp.text}")
    acks = [ok(await pub.pub(p["topic"], b.encode())) for b in p["bodies"]]
    sub, resp = await connection(p["conn"]["auth_secret"])
    await sub.subscribe(p["topic"], p["channel"], 5)
    received = []
    while len(received) < len(p["bodies"]):
        m = await asyncio.wait_for(sub.wait_for_message(), 5)
        received.append([_s(m.body), m.attempts])
        await m.fin()
    _, bad = await connection(p["bad_secret"])
    po, resp = await connection(p["pub_only_secret"])
    pub_only_ack = ok(await po.pub(p["topic"] + "_po", b"by-publisher"))
    po_sub, _ = await connection(p["pub_only_secret"])
    sub_resp = await po_sub.sub(p["topic"], p["channel"])
    return {"acks": acks, "received": received, "bad_secret_errors": [ok(bad)],
            "pub_only_ack": pub_only_ack, "pub_only_sub_errors": [ok(sub_resp)]}


async def reconnect(ctx: Ctx, on_event) -> dict:
    p = ctx.p
    n = p["n"]
    received: list[str] = []
    acked: list[str] = []
    r = await ctx.reader(p["channel"])

    async def handler(m):
        received.append(_s(m.body))
        # a slow consumer, so acked messages wait in the queue at the crash
        await asyncio.sleep(p["consume_delay_ms"] / 1000)
        try:
            await m.fin()
        except Exception:
            pass  # the connection may be gone; the message comes again

    ctx.consume(r, handler)
    w = await ctx.writer()
    errors = 0
    deadline = time.monotonic() + p.get("wait", 40)
    for i in range(n):
        body = f"r-{i}"
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not publish {body}")
            try:
                if w is None:
                    w = await ctx.writer()
                resp = await asyncio.wait_for(w.pub(p["topic"], body.encode()), 5)
                if resp is not None and resp.is_ok:
                    break
            except Exception:
                pass
            errors += 1
            # ansq's own reconnect of a connection that had a PUB in flight keeps the
            # stale response waiter, so every later response goes to the wrong
            # command: drop this writer and make a new one instead.
            if w is not None:
                for conn in w.connections:
                    conn._auto_reconnect = False
                try:
                    await asyncio.wait_for(w.close(), 2)
                except Exception:
                    pass
                w = None
            await asyncio.sleep(0.1)
        acked.append(body)
        if on_event is not None:
            await on_event({"event": "progress", "acked": len(acked), "received": len(received)})
    await until(lambda: set(acked) <= set(received), p.get("wait", 40), "every acked message")
    await asyncio.sleep(0.3)
    return {"acked": acked, "received": received, "publish_errors": errors}


SCENARIOS = {"pubsub": pubsub, "dpub": dpub, "req": req, "touch": touch, "timeout": timeout,
             "multi_consumer": multi_consumer, "multi_channel": multi_channel,
             "heartbeat": heartbeat, "auth": auth}


async def run(params: dict, on_event=None) -> dict:
    ctx = Ctx(params)
    try:
        if params["scenario"] == "reconnect":
            return await reconnect(ctx, on_event)
        return await SCENARIOS[params["scenario"]](ctx)
    finally:
        await ctx.close()
