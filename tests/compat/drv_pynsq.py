"""pynsq 0.9.1 (tornado) scenarios, run in-process on the test's asyncio loop
(tornado 6 IOLoops wrap the running asyncio loop).

Library facts these scenarios rely on (read from pynsq's source):
- Writer.pub/mpub/dpub take a callback(conn, data): data is b"OK" or an nsq.Error;
  publishing before a connection is up fails at once ("no open connections");
- Writer reconnects after `reconnect_interval`; a Reader with nsqd_tcp_addresses
  reconnects a closed connection after a hard-coded 15 s;
- msg_timeout is in seconds (sent as ms in IDENTIFY), heartbeat_interval in s;
- TLS options are a dict for tornado's ssl_options (cert_reqs, ca_certs, ...).
"""

from __future__ import annotations

import asyncio
import ssl
import time

import nsq


def conn_kwargs(opts: dict | None) -> dict:
    opts = opts or {}
    kw: dict = {}
    if opts.get("tls"):
        kw["tls_v1"] = True
        # pynsq asks tornado for TLSv1.2 and server_hostname=host; verify against our CA.
        kw["tls_options"] = {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": opts["tls"]["ca"]}
    if opts.get("snappy"):
        kw["snappy"] = True
    if opts.get("deflate"):
        kw["deflate"] = True
        kw["deflate_level"] = opts.get("deflate_level", 6)
    if opts.get("auth_secret"):
        kw["auth_secret"] = opts["auth_secret"]
    if opts.get("msg_timeout_ms"):
        kw["msg_timeout"] = opts["msg_timeout_ms"] / 1000
    if opts.get("heartbeat_ms"):
        kw["heartbeat_interval"] = opts["heartbeat_ms"] // 1000
    return kw


class Recorder(nsq.Reader):
    """A Reader that counts heartbeats, connections and errors."""

    def __init__(self, *a, **kw):
        self.heartbeats = 0
        self.readies = 0
        self.errors: list[str] = []
        super().__init__(*a, **kw)

    def heartbeat(self, conn):
        self.heartbeats += 1

    def _on_connection_ready(self, conn, **kwargs):
        self.readies += 1
        super()._on_connection_ready(conn, **kwargs)

    def _on_connection_error(self, conn, error, **kwargs):
        self.errors.append(str(error))
        super()._on_connection_error(conn, error, **kwargs)

    def _on_connection_identify_response(self, conn, data, **kwargs):
        IDENTIFIED.append(data)
        super()._on_connection_identify_response(conn, data, **kwargs)


IDENTIFIED: list[dict] = []  # IDENTIFY responses (what was negotiated), reset per scenario


class Ctx:
    """Clients of one scenario, closed at the end whatever happens."""

    def __init__(self, params: dict):
        self.p = params
        self.t0 = time.monotonic()
        self.readers: list[nsq.Reader] = []
        self.writers: list[nsq.Writer] = []
        self.writer_errors: list[str] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def writer(self, opts=None, reconnect_interval=0.3) -> nsq.Writer:
        ctx = self

        class W(nsq.Writer):
            def _on_connection_error(self, conn, error, **kwargs):
                ctx.writer_errors.append(str(error))
                super()._on_connection_error(conn, error, **kwargs)

            def _on_connection_identify_response(self, conn, data, **kwargs):
                IDENTIFIED.append(data)
                super()._on_connection_identify_response(conn, data, **kwargs)

        w = W([self.p["tcp"]], reconnect_interval=reconnect_interval,
              **conn_kwargs(self.p.get("conn") if opts is None else opts))
        self.writers.append(w)
        return w

    def reader(self, channel, handler, opts=None, **kw) -> Recorder:
        r = Recorder(self.p["topic"], channel, message_handler=handler,
                     nsqd_tcp_addresses=[self.p["tcp"]],
                     **kw, **conn_kwargs(self.p.get("conn") if opts is None else opts))
        self.readers.append(r)
        return r

    def close(self) -> None:
        for c in self.readers + self.writers:
            c.connect_to_nsqd = lambda *a, **k: None  # no reconnects after the scenario
            for conn in list(c.conns.values()):
                conn.close()
            if isinstance(c, nsq.Reader) and c.redist_periodic is not None:
                c.redist_periodic.stop()


async def until(cond, timeout: float, what: str, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(step)


async def connected(w: nsq.Writer, timeout: float = 5) -> None:
    await until(lambda: any(c.connected() for c in w.conns.values()), timeout, "writer connection")


async def subscribed(r: nsq.Reader, timeout: float = 5) -> None:
    await until(lambda: bool(r.conns), timeout, "reader connection")
    await asyncio.sleep(0.1)  # SUB and RDY are on the wire


def publish(w: nsq.Writer, command: str, topic: str, *args) -> asyncio.Future:
    """PUB/MPUB/DPUB; the future resolves to the response (b"OK") or raises the error."""
    fut = asyncio.get_running_loop().create_future()

    def done(conn, data):
        if fut.done():
            return
        if isinstance(data, Exception):
            fut.set_exception(data)
        else:
            fut.set_result(data)

    if command == "dpub":
        w.dpub(topic, args[0], args[1], callback=done)
    else:
        getattr(w, command)(topic, args[0], callback=done)
    return fut


def _b(s: str) -> bytes:
    return s.encode()


def _s(b: bytes) -> str:
    return b.decode()


# ---- scenarios -----------------------------------------------------------------


async def pubsub(ctx: Ctx) -> dict:
    p = ctx.p
    bodies = p["bodies"]
    w = ctx.writer()
    await connected(w)
    acks = []
    if p.get("mode") == "mpub":
        acks.append(_s(await publish(w, "mpub", p["topic"], [_b(b) for b in bodies])))
    else:
        for b in bodies:
            acks.append(_s(await publish(w, "pub", p["topic"], _b(b))))
    received = []

    def handler(m):
        received.append([_s(m.body), m.attempts])
        return True

    ctx.reader(p["channel"], handler, max_in_flight=p.get("max_in_flight", 10))
    await until(lambda: len(received) >= len(bodies), p.get("wait", 10), "all messages")
    await asyncio.sleep(p.get("linger", 0.3))
    return {"acks": acks, "received": list(received), "identify": list(IDENTIFIED)}


async def dpub(ctx: Ctx) -> dict:
    p = ctx.p
    received = []

    def handler(m):
        received.append([_s(m.body), m.attempts, ctx.now()])
        return True

    r = ctx.reader(p["channel"], handler, max_in_flight=10)
    w = ctx.writer()
    await connected(w)
    await subscribed(r)
    t_send = ctx.now()
    ack_later = await publish(w, "dpub", p["topic"], p["defer_ms"], b"later")
    ack_now = await publish(w, "pub", p["topic"], b"now")
    await until(lambda: len(received) >= 2, p["defer_ms"] / 1000 + 5, "deferred message")
    await asyncio.sleep(0.3)
    return {"acks": [_s(ack_later), _s(ack_now)], "t_send": t_send, "received": received}


async def req(ctx: Ctx) -> dict:
    p = ctx.p
    received = []

    def handler(m):
        received.append([_s(m.body), m.attempts, ctx.now()])
        m.enable_async()
        if m.attempts == 1:
            m.requeue(time_ms=p["req_ms"], backoff=False)
        else:
            m.finish()

    w = ctx.writer()
    await connected(w)
    await publish(w, "pub", p["topic"], b"again")
    ctx.reader(p["channel"], handler)
    await until(lambda: len(received) >= 2, 10, "redelivery after REQ")
    await asyncio.sleep(0.5)
    return {"received": received}


async def touch(ctx: Ctx) -> dict:
    p = ctx.p
    received = []
    state = {}
    loop = asyncio.get_running_loop()

    async def hold(m):
        end = time.monotonic() + p["hold_ms"] / 1000
        while time.monotonic() < end:
            await asyncio.sleep(p["touch_every_ms"] / 1000)
            m.touch()
        m.finish()
        state["fin_t"] = ctx.now()

    def handler(m):
        received.append([_s(m.body), m.attempts, ctx.now()])
        m.enable_async()
        if m.attempts == 1:
            loop.create_task(hold(m))
        else:
            m.finish()

    w = ctx.writer()
    await connected(w)
    await publish(w, "pub", p["topic"], b"touched")
    ctx.reader(p["channel"], handler)
    await until(lambda: "fin_t" in state, p["hold_ms"] / 1000 + 5, "FIN after touching")
    await asyncio.sleep(p["linger_ms"] / 1000)
    return {"received": received, "fin_t": state["fin_t"]}


async def timeout(ctx: Ctx) -> dict:
    p = ctx.p
    received = []

    def handler(m):
        received.append([_s(m.body), m.attempts, ctx.now()])
        m.enable_async()
        if m.attempts > 1:
            m.finish()  # the first delivery is never answered: it must time out

    w = ctx.writer()
    await connected(w)
    await publish(w, "pub", p["topic"], b"slow")
    ctx.reader(p["channel"], handler)
    await until(lambda: len(received) >= 2, p.get("wait", 10), "redelivery after timeout")
    await asyncio.sleep(0.3)
    return {"received": received}


async def multi_consumer(ctx: Ctx) -> dict:
    p = ctx.p
    loop = asyncio.get_running_loop()
    got: list[list[str]] = [[], []]

    def make(i):
        def handler(m):
            got[i].append(_s(m.body))
            m.enable_async()
            loop.call_later(0.005, m.finish)  # a little work, so the other consumer gets a turn
        return handler

    readers = [ctx.reader(p["channel"], make(i), max_in_flight=2) for i in range(2)]
    w = ctx.writer()
    await connected(w)
    for r in readers:
        await subscribed(r)
    for b in p["bodies"]:
        await publish(w, "pub", p["topic"], _b(b))
    await until(lambda: len(got[0]) + len(got[1]) >= len(p["bodies"]), 10, "all messages")
    await asyncio.sleep(0.5)
    return {"consumers": got}


async def multi_channel(ctx: Ctx) -> dict:
    p = ctx.p
    got = {c: [] for c in p["channels"]}

    def make(c):
        def handler(m):
            got[c].append(_s(m.body))
            return True
        return handler

    readers = [ctx.reader(c, make(c), max_in_flight=10) for c in p["channels"]]
    w = ctx.writer()
    await connected(w)
    for r in readers:
        await subscribed(r)
    await publish(w, "mpub", p["topic"], [_b(b) for b in p["bodies"]])
    await until(lambda: all(len(v) >= len(p["bodies"]) for v in got.values()), 10,
                "every channel's copy")
    await asyncio.sleep(0.3)
    return {"channels": got}


async def heartbeat(ctx: Ctx) -> dict:
    p = ctx.p
    received = []

    def handler(m):
        received.append([_s(m.body), m.attempts])
        return True

    r = ctx.reader(p["channel"], handler)
    await subscribed(r)
    await asyncio.sleep(p["idle_s"])
    heartbeats, connects = r.heartbeats, r.readies
    w = ctx.writer({})
    await connected(w)
    await publish(w, "pub", p["topic"], b"after-idle")
    await until(lambda: received, 5, "message after the idle period")
    return {"heartbeats": heartbeats, "connects": r.readies, "connects_before_pub": connects,
            "received": received, "errors": r.errors}


async def auth(ctx: Ctx) -> dict:
    p = ctx.p
    result = await pubsub(ctx)
    # A wrong secret: the connection gets an error (E_AUTH_FAILED) and is closed.
    bad = ctx.writer(dict(p["conn"], auth_secret=p["bad_secret"]), reconnect_interval=60)
    await until(lambda: ctx.writer_errors, 5, "AUTH error for a bad secret")
    result["bad_secret_errors"] = list(ctx.writer_errors)
    assert not any(c.connected() for c in bad.conns.values())
    # A publish-only identity may publish but not subscribe (E_UNAUTHORIZED).
    w = ctx.writer(dict(p["conn"], auth_secret=p["pub_only_secret"]))
    await connected(w)
    result["pub_only_ack"] = _s(await publish(w, "pub", p["topic"] + "_po", b"by-publisher"))
    r = ctx.reader(p["channel"], lambda m: True, opts=dict(p["conn"], auth_secret=p["pub_only_secret"]))
    await until(lambda: r.errors, 5, "SUB refused")
    result["pub_only_sub_errors"] = r.errors
    return result


async def reconnect(ctx: Ctx, on_event) -> dict:
    p = ctx.p
    n = p["n"]
    received = []
    acked: list[str] = []
    loop = asyncio.get_running_loop()

    def handler(m):
        received.append(_s(m.body))
        m.enable_async()  # a slow consumer, so acked messages wait in the queue at the crash
        loop.call_later(p["consume_delay_ms"] / 1000, m.finish)

    ctx.reader(p["channel"], handler, max_in_flight=5)
    w = ctx.writer(reconnect_interval=0.3)
    await connected(w)
    errors = 0
    deadline = time.monotonic() + p.get("wait", 40)
    for i in range(n):
        body = f"r-{i}"
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not publish {body}")
            try:
                await asyncio.wait_for(publish(w, "pub", p["topic"], _b(body)), 5)
                break
            except Exception:
                errors += 1
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
    IDENTIFIED.clear()
    ctx = Ctx(params)
    try:
        if params["scenario"] == "reconnect":
            return await reconnect(ctx, on_event)
        return await SCENARIOS[params["scenario"]](ctx)
    finally:
        ctx.close()
