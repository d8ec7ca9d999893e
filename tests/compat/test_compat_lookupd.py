"""Real consumers that find our nsqd only through our nsqlookupd (classic mode):
pynsq `Reader(lookupd_http_addresses=...)`, gnsq `Consumer(lookupd_http_addresses=...)`
and nsqjs `Reader({lookupdHTTPAddresses})`, each receiving what was published, from two
nsqd nodes registered with one lookupd."""

from __future__ import annotations

import asyncio
import os
import shutil
import urllib.request

import pytest

from compat_util import JS_DIR, PYTHON, run_process, unique
from servers import NsqdProcess, NsqlookupdProcess

GNSQ_CONSUMER = r"""
from gevent import monkey
monkey.patch_all()
import json, sys, gevent, gnsq
p = json.load(sys.stdin)
got, connected = [], []
c = gnsq.Consumer(p["topic"], p["channel"], lookupd_http_addresses=[p["lookupd"]],
                  lookupd_poll_interval=1, max_in_flight=10)
@c.on_message.connect
def handler(consumer, message):
    got.append(message.body.decode())
    if len(got) >= p["count"]:
        # a gnsq Message does not name its connection: the consumer's connections do
        connected.extend("%s:%d" % (conn.address, conn.port) for conn in consumer._connections)
        consumer.close()
gevent.spawn(c.start)
with gevent.Timeout(p["wait"], False):
    while len(got) < p["count"]:
        gevent.sleep(0.05)
print(json.dumps({"result": {"received": got, "connected": connected}}), flush=True)
"""

NSQJS_CONSUMER = r"""
const nsq = require('nsqjs')
let input = ''
process.stdin.on('data', (d) => { input += d })
process.stdin.on('end', () => {
  const p = JSON.parse(input)
  const got = []
  const connected = []
  const r = new nsq.Reader(p.topic, p.channel, {lookupdHTTPAddresses: [p.lookupd],
                                                lookupdPollInterval: 1, maxInFlight: 10})
  const done = () => {
    process.stdout.write(JSON.stringify({result: {received: got, connected}}) + '\n')
    r.close()
    setTimeout(() => process.exit(0), 100)
  }
  // an nsqjs Message does not name its nsqd: the reader's connect events do
  r.on('nsqd_connected', (host, port) => connected.push(`${host}:${port}`))
  r.on('message', (m) => {
    got.push(m.body.toString())
    m.finish()
    if (got.length >= p.count) done()
  })
  r.connect()
  setTimeout(done, p.wait * 1000)
})
"""


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("lookupd_compat"))
    lookupd = NsqlookupdProcess(base).start()
    nodes = [NsqdProcess(os.path.join(base, f"nsqd{i}"), "--lookupd-tcp-address",
                         lookupd.tcp_address).start() for i in range(2)]
    yield lookupd, nodes
    for n in nodes:
        n.kill()
    lookupd.kill()


def publish_to_both(nodes, topic: str, per_node: int) -> set[str]:
    """Publish on each node (which registers the topic), wait until the lookupd lists both."""
    bodies = set()
    for i, n in enumerate(nodes):
        for j in range(per_node):
            body = f"n{i}-m{j}"
            req = urllib.request.Request(f"http://{n.http_address}/pub?topic={topic}",
                                         data=body.encode(), method="POST")
            urllib.request.urlopen(req, timeout=5).read()
            bodies.add(body)
    return bodies


async def registered(lookupd, topic: str, count: int) -> None:
    import json

    for _ in range(200):
        try:
            with urllib.request.urlopen(f"http://{lookupd.http_address}/lookup?topic={topic}",
                                        timeout=2) as r:
                if len(json.loads(r.read())["producers"]) == count:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{topic} not registered by {count} nodes")


def check(result, bodies, nodes):
    """Every body once (each node published its own), and connections to exactly the
    addresses the lookupd gave (broadcast address and TCP port of both nodes)."""
    assert sorted(result["received"]) == sorted(bodies)
    assert set(result["connected"]) == {f"127.0.0.1:{n.tcp_port}" for n in nodes}


async def test_pynsq_reader_finds_nodes_through_lookupd(two_nodes):
    import nsq

    lookupd, nodes = two_nodes
    topic = unique("lk_pynsq")
    bodies = publish_to_both(nodes, topic, 3)
    await registered(lookupd, topic, 2)
    received = []

    def handler(m):
        received.append(m.body.decode())
        return True

    r = nsq.Reader(topic=topic, channel="ch", message_handler=handler,
                   lookupd_http_addresses=[f"http://{lookupd.http_address}"],
                   lookupd_poll_interval=1, max_in_flight=10)
    try:
        for _ in range(300):
            if len(received) >= len(bodies):
                break
            await asyncio.sleep(0.05)
        assert set(received) == bodies
        assert {f"{c.host}:{c.port}" for c in r.conns.values()} == {
            f"127.0.0.1:{n.tcp_port}" for n in nodes}
    finally:
        r.query_periodic.stop()
        r.redist_periodic.stop()
        for conn in list(r.conns.values()):
            conn.close()


async def test_gnsq_consumer_finds_nodes_through_lookupd(two_nodes):
    lookupd, nodes = two_nodes
    topic = unique("lk_gnsq")
    bodies = publish_to_both(nodes, topic, 3)
    await registered(lookupd, topic, 2)
    result = await run_process([PYTHON, "-c", GNSQ_CONSUMER],
                               {"topic": topic, "channel": "ch", "count": len(bodies),
                                "lookupd": lookupd.http_address, "wait": 20}, timeout=40)
    check(result, bodies, nodes)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
async def test_nsqjs_reader_finds_nodes_through_lookupd(two_nodes):
    lookupd, nodes = two_nodes
    topic = unique("lk_nsqjs")
    bodies = publish_to_both(nodes, topic, 3)
    await registered(lookupd, topic, 2)
    result = await run_process([shutil.which("node"), "-e", NSQJS_CONSUMER],
                               {"topic": topic, "channel": "ch", "count": len(bodies),
                                "lookupd": lookupd.http_address, "wait": 20},
                               timeout=40, cwd=JS_DIR)
    check(result, bodies, nodes)
