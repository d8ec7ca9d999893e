"""pynsq finds its nsqd through our nsqlookupd in cluster mode: the cluster `/lookup`
(classic keys plus `partitions` and `meta`) is read by an unchanged pynsq Reader.

The nsqd is a real one in classic mode (the cluster driver of nsqd is another part); its
NodeInfo is held in a real etcd under a lease by a child process, as a cluster nsqd would
register itself, and the topic (one partition, so that node leads it) is created through
the lookupd's /topic/create."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request

from isr import keys
from isr.state import NodeInfo
from servers import ROOT, NsqdProcess, NsqlookupdProcess

HOLDER = os.path.join(ROOT, "tests", "isr_holder.py")


def call(url: str, method: str = "GET") -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as r:
        return r.read()


async def test_pynsq_reader_through_a_cluster_lookupd(etcd_server, tmp_path):
    import nsq

    node = NsqdProcess(str(tmp_path / "nsqd")).start()
    info = NodeInfo(id=node.tcp_address, tcp=node.tcp_address, http=node.http_address,
                    rpc="127.0.0.1:4250", hostname="n1", version="1.3.0")
    holder = subprocess.Popen([sys.executable, HOLDER, "register", etcd_server.endpoint,
                               keys.node("nsq", info.id), info.encode().decode(), "2"],
                              stdout=subprocess.PIPE, cwd=ROOT)
    lookupd = NsqlookupdProcess(str(tmp_path), "--etcd-endpoints", etcd_server.endpoint,
                                "--etcd-lease-ttl", "2s").start()
    reader = None
    try:
        assert holder.stdout.readline() == b"ready\n"
        base = f"http://{lookupd.http_address}"
        for _ in range(200):
            if json.loads(call(f"{base}/info"))["cluster"]["is_master"]:
                break
            await asyncio.sleep(0.05)
        call(f"{base}/topic/create?topic=cl_pynsq&partition_num=1", "POST")
        lookup = json.loads(call(f"{base}/lookup?topic=cl_pynsq"))
        assert lookup["partitions"]["0"]["tcp_port"] == node.tcp_port
        bodies = {f"m{i}" for i in range(5)}
        for b in sorted(bodies):
            urllib.request.urlopen(urllib.request.Request(
                f"http://{node.http_address}/pub?topic=cl_pynsq", data=b.encode(),
                method="POST"), timeout=5).read()
        received = []

        def handler(m):
            received.append(m.body.decode())
            return True

        reader = nsq.Reader(topic="cl_pynsq", channel="ch", message_handler=handler,
                            lookupd_http_addresses=[base], lookupd_poll_interval=1,
                            max_in_flight=10)
        for _ in range(300):
            if len(received) >= len(bodies):
                break
            await asyncio.sleep(0.05)
        assert set(received) == bodies
        assert {f"{c.host}:{c.port}" for c in reader.conns.values()} == {node.tcp_address}
    finally:
        if reader is not None:
            reader.query_periodic.stop()
            reader.redist_periodic.stop()
            for c in list(reader.conns.values()):
                c.close()
        holder.kill()
        holder.wait()
        lookupd.kill()
        node.kill()
