"""gnsq 1.0.2 (gevent) scenarios, run in their own interpreter: gevent
monkey-patches sockets, threads and time, which must not happen inside pytest.

    echo '<json params>' | python gnsq_scenarios.py

Prints progress events as JSON lines and finally {"result": {...}} (or
{"result": {"error": "..."}}). See compat_util for the scenario shapes.

Library facts these scenarios rely on (read from gnsq's source):
- Producer.publish/multipublish block until nsqd answers and return b"OK" or
  raise; publish(defer=ms) sends DPUB;
- Consumer(message_handler=f(consumer, message)) finishes a message when the
  handler returns, unless message.enable_async() was called;
- heartbeat_interval is in seconds; IDENTIFY has no msg_timeout field, so the
  msg-timeout scenarios run against a server started with --msg-timeout;
- connections that fail are retried with a random backoff (< 2^n - 1 s).
"""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import logging  # noqa: E402
import ssl  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import gevent  # noqa: E402
import gnsq  # noqa: E402

logging.basicConfig(level=int(__import__("os").environ.get("GNSQ_LOG", logging.CRITICAL)), stream=sys.stderr)

T0 = time.monotonic()


def now():
    return time.monotonic() - T0


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


IDENTIFIED = []  # IDENTIFY responses of every connection (what was negotiated)


class RecordingClient(gnsq.NsqdTCPClient):
    def identify(self):
        data = super().identify()
        IDENTIFIED.append(data)
        return data


gnsq.consumer.NsqdTCPClient = RecordingClient
gnsq.producer.NsqdTCPClient = RecordingClient


def conn_kwargs(opts):
    opts = opts or {}
    kw = {}
    if opts.get("tls"):
        kw["tls_v1"] = True
        kw["tls_options"] = {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": opts["tls"]["ca"]}
    if opts.get("snappy"):
        kw["snappy"] = True
    if opts.get("deflate"):
        kw["deflate"] = True
    if opts.get("auth_secret"):
        kw["auth_secret"] = opts["auth_secret"].encode()  # gnsq wants bytes
    if opts.get("heartbeat_ms"):
        kw["heartbeat_interval"] = opts["heartbeat_ms"] // 1000
    if opts.get("msg_timeout_ms"):
        raise NotImplementedError("gnsq 1.0.2 cannot send msg_timeout in IDENTIFY")
    return kw


class Ctx:
    def __init__(self, p):
        self.p = p
        self.clients = []

    def producer(self, opts=None):
        opts = self.p.get("conn") if opts is None else opts
        if opts and (opts.get("tls") or opts.get("snappy") or opts.get("deflate")):
            prod = UpgradedProducer(self.p["tcp"], **conn_kwargs(opts))
        else:
            prod = gnsq.Producer([self.p["tcp"]], **conn_kwargs(opts))
            prod.start()
        self.clients.append(prod)
        return prod

    def consumer(self, channel, handler, opts=None, start=True, **kw):
        c = Counting(self.p["topic"], channel, nsqd_tcp_addresses=[self.p["tcp"]],
                     message_handler=handler,
                     **kw, **conn_kwargs(self.p.get("conn") if opts is None else opts))
        self.clients.append(c)
        if start:
            c.start(block=False)
        return c

    def close(self):
        for c in self.clients:
            try:
                c.close()
            except Exception:
                pass


class UpgradedProducer:
    """Publishing over TLS/snappy/deflate with gnsq's NsqdTCPClient.

    gnsq 1.0.2's Producer cannot: the OK that confirms an upgrade reaches its
    response handler before the connection has a response queue (KeyError;
    wtolson/gnsq#25, the same against Go nsqd). The Consumer is not affected."""

    def __init__(self, address, **kw):
        host, port = address.split(":")
        self.conn = RecordingClient(host, int(port), **kw)
        self.conn.connect()
        self.conn.identify()

    def _response(self):
        while True:
            frame, data = self.conn.read_response()
            if frame == gnsq.protocol.FRAME_TYPE_ERROR:
                raise data
            if data != b"_heartbeat_":
                return data

    def publish(self, topic, data, defer=None, **kw):
        self.conn.publish(topic, data, defer=defer)
        return self._response()

    def multipublish(self, topic, messages, **kw):
        self.conn.multipublish(topic, messages)
        return self._response()

    def close(self):
        self.conn.close_stream()


class Counting(gnsq.Consumer):
    """A Consumer that counts its successful connections, heartbeats and errors."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.connects = 0
        self.heartbeats = 0
        self.errors = []
        self.on_response.connect(self._count_response, weak=False)
        self.on_error.connect(self._count_error, weak=False)

    def handle_connection_success(self, conn):
        self.connects += 1
        super().handle_connection_success(conn)

    def _count_response(self, sender, response):
        if response == b"_heartbeat_":
            self.heartbeats += 1

    def _count_error(self, sender, error):
        self.errors.append(error_text(error))


CODES = {cls: code for code, cls in gnsq.errors.ERROR_CODES.items()}


def error_text(error):
    """gnsq maps an error frame's code to an exception class; map it back."""
    return "%s %s" % (CODES.get(type(error), type(error).__name__), error)


def until(cond, timeout, what, step=0.02):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out waiting for " + what)
        gevent.sleep(step)


def wait_subscribed(c, timeout=5):
    until(lambda: c.connects > 0, timeout, "consumer connection")
    gevent.sleep(0.1)


def s(b):
    return b.decode()


# ---- scenarios -----------------------------------------------------------------


def pubsub(ctx):
    p = ctx.p
    bodies = p["bodies"]
    prod = ctx.producer()
    acks = []
    if p.get("mode") == "mpub":
        acks.append(s(prod.multipublish(p["topic"], [b.encode() for b in bodies])))
    else:
        for b in bodies:
            acks.append(s(prod.publish(p["topic"], b.encode())))
    received = []

    def handler(consumer, message):
        m = message
        received.append([s(m.body), m.attempts])

    ctx.consumer(p["channel"], handler, max_in_flight=10)
    until(lambda: len(received) >= len(bodies), 15, "all messages")
    gevent.sleep(0.3)
    return {"acks": acks, "received": list(received), "identify": list(IDENTIFIED)}


def dpub(ctx):
    p = ctx.p
    received = []

    def handler(consumer, message):
        m = message
        received.append([s(m.body), m.attempts, now()])

    c = ctx.consumer(p["channel"], handler, max_in_flight=10)
    prod = ctx.producer()
    wait_subscribed(c)
    t_send = now()
    ack_later = s(prod.publish(p["topic"], b"later", defer=p["defer_ms"]))
    ack_now = s(prod.publish(p["topic"], b"now"))
    until(lambda: len(received) >= 2, p["defer_ms"] / 1000 + 5, "deferred message")
    gevent.sleep(0.3)
    return {"acks": [ack_later, ack_now], "t_send": t_send, "received": received}


def req(ctx):
    p = ctx.p
    received = []

    def handler(consumer, message):
        m = message
        received.append([s(m.body), m.attempts, now()])
        if m.attempts == 1:
            m.requeue(time_ms=p["req_ms"], backoff=False)

    prod = ctx.producer()
    prod.publish(p["topic"], b"again")
    ctx.consumer(p["channel"], handler)
    until(lambda: len(received) >= 2, 10, "redelivery after REQ")
    gevent.sleep(0.5)
    return {"received": received}


def touch(ctx):
    p = ctx.p
    received = []
    state = {}

    def hold(m):
        end = time.monotonic() + p["hold_ms"] / 1000
        while time.monotonic() < end:
            gevent.sleep(p["touch_every_ms"] / 1000)
            m.touch()
        m.finish()
        state["fin_t"] = now()

    def handler(consumer, message):
        m = message
        received.append([s(m.body), m.attempts, now()])
        if m.attempts == 1:
            m.enable_async()
            gevent.spawn(hold, m)

    prod = ctx.producer()
    prod.publish(p["topic"], b"touched")
    ctx.consumer(p["channel"], handler)
    until(lambda: "fin_t" in state, p["hold_ms"] / 1000 + 5, "FIN after touching")
    gevent.sleep(p["linger_ms"] / 1000)
    return {"received": received, "fin_t": state["fin_t"]}


def timeout(ctx):
    p = ctx.p
    received = []

    def handler(consumer, message):
        m = message
        received.append([s(m.body), m.attempts, now()])
        if m.attempts == 1:
            m.enable_async()  # never answered: it must time out

    prod = ctx.producer()
    prod.publish(p["topic"], b"slow")
    ctx.consumer(p["channel"], handler)
    until(lambda: len(received) >= 2, 10, "redelivery after timeout")
    gevent.sleep(0.3)
    return {"received": received}


def multi_consumer(ctx):
    p = ctx.p
    got = [[], []]

    def make(i):
        def handler(consumer, message):
            m = message
            got[i].append(s(m.body))
            gevent.sleep(0.005)
        return handler

    consumers = [ctx.consumer(p["channel"], make(i), max_in_flight=2) for i in range(2)]
    prod = ctx.producer()
    for c in consumers:
        wait_subscribed(c)
    for b in p["bodies"]:
        prod.publish(p["topic"], b.encode())
    until(lambda: len(got[0]) + len(got[1]) >= len(p["bodies"]), 15, "all messages")
    gevent.sleep(0.5)
    return {"consumers": got}


def multi_channel(ctx):
    p = ctx.p
    got = {c: [] for c in p["channels"]}

    def make(name):
        def handler(consumer, message):
            m = message
            got[name].append(s(m.body))
        return handler

    consumers = [ctx.consumer(c, make(c), max_in_flight=10) for c in p["channels"]]
    prod = ctx.producer()
    for c in consumers:
        wait_subscribed(c)
    prod.multipublish(p["topic"], [b.encode() for b in p["bodies"]])
    until(lambda: all(len(v) >= len(p["bodies"]) for v in got.values()), 15,
          "every channel's copy")
    gevent.sleep(0.3)
    return {"channels": got}


def heartbeat(ctx):
    p = ctx.p
    received = []

    def handler(consumer, message):
        m = message
        received.append([s(m.body), m.attempts])

    c = ctx.consumer(p["channel"], handler)
    wait_subscribed(c)
    gevent.sleep(p["idle_s"])
    heartbeats, before = c.heartbeats, c.connects
    prod = ctx.producer({})
    prod.publish(p["topic"], b"after-idle")
    until(lambda: received, 5, "message after the idle period")
    return {"heartbeats": heartbeats, "connects": c.connects, "connects_before_pub": before,
            "received": received, "errors": c.errors}


def auth(ctx):
    p = ctx.p
    result = pubsub(ctx)
    errors = []
    bad = gnsq.Producer([p["tcp"]], **conn_kwargs(dict(p["conn"], auth_secret=p["bad_secret"])))
    bad.on_error.connect(lambda sender, error: errors.append(error_text(error)), weak=False)
    ctx.clients.append(bad)
    bad.start()
    until(lambda: errors, 5, "AUTH error for a bad secret")
    result["bad_secret_errors"] = errors
    po = dict(p["conn"], auth_secret=p["pub_only_secret"])
    prod = ctx.producer(po)
    result["pub_only_ack"] = s(prod.publish(p["topic"] + "_po", b"by-publisher"))
    c = ctx.consumer(p["channel"], lambda consumer, message: None, opts=po)
    until(lambda: c.errors, 5, "SUB refused")
    result["pub_only_sub_errors"] = c.errors
    return result


def reconnect(ctx):
    p = ctx.p
    n = p["n"]
    received = []
    acked = []

    def handler(consumer, message):
        m = message
        received.append(s(m.body))
        # a slow consumer, so acked messages wait in the queue at the crash
        gevent.sleep(p["consume_delay_ms"] / 1000)

    ctx.consumer(p["channel"], handler, max_in_flight=5)
    prod = ctx.producer()
    errors = 0
    deadline = time.monotonic() + p.get("wait", 40)
    for i in range(n):
        body = "r-%d" % i
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError("could not publish " + body)
            try:
                if prod.publish(p["topic"], body.encode(), timeout=5) == b"OK":
                    break
            except Exception:
                pass
            errors += 1
            gevent.sleep(0.1)
        acked.append(body)
        emit({"event": "progress", "acked": len(acked), "received": len(received)})
    until(lambda: set(acked) <= set(received), p.get("wait", 40), "every acked message")
    gevent.sleep(0.3)
    return {"acked": acked, "received": received, "publish_errors": errors}


SCENARIOS = {"pubsub": pubsub, "dpub": dpub, "req": req, "touch": touch, "timeout": timeout,
             "multi_consumer": multi_consumer, "multi_channel": multi_channel,
             "heartbeat": heartbeat, "auth": auth, "reconnect": reconnect}


def main():
    params = json.loads(sys.stdin.read())
    ctx = Ctx(params)
    try:
        result = SCENARIOS[params["scenario"]](ctx)
    except Exception as e:
        result = {"error": "%s: %s\n%s" % (type(e).__name__, e, traceback.format_exc())}
    finally:
        ctx.close()
    emit({"result": result})
    sys.stdout.flush()
    # gevent greenlets (reconnect timers) must not keep the process alive
    import os
    os._exit(0)


if __name__ == "__main__":
    main()
