"""A child process for tests (test_isr_cluster.py, test_lookupd_cluster.py,
test_lookupd_failover.py): registers a key, or campaigns for a master key, or registers a
node and holds the leader keys of some partitions (LeaderKeys, as a leading nsqd does);
prints `ready` once it holds it (or runs), then waits to be killed.

    python isr_holder.py register ENDPOINT KEY VALUE TTL
    python isr_holder.py elect ENDPOINT KEY MY_ID TTL
    python isr_holder.py lead ENDPOINT CLUSTER NODE_INFO_JSON TTL [TOPIC:N,...]
"""

import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's isr

import structlog

from isr import keys
from isr.election import Election
from isr.etcd import Etcd
from isr.leadership import LeaderKeys
from isr.registry import Registration
from isr.state import NodeInfo


async def main(mode: str, endpoint: str, key: str, value: str, ttl: str,
               partitions: str = "") -> None:
    etcd = Etcd(endpoint, timeout=1)
    if mode == "lead":
        info = NodeInfo.decode(value.encode())
        reg = Registration(etcd, keys.node(key, info.id), value.encode(), int(ttl)).start()
        await reg.wait_registered(30)
        leader_keys = LeaderKeys(etcd, key, info.id, reg).start()
        wanted = {(p.rpartition(":")[0], int(p.rpartition(":")[2]))
                  for p in partitions.split(",") if p}
        await leader_keys.hold(wanted)
    elif mode == "register":
        reg = Registration(etcd, key, value.encode(), int(ttl)).start()
        await reg.wait_registered(30)
    else:
        election = Election(etcd, key, value, int(ttl)).start()
        while election.master_id is None:
            await asyncio.sleep(0.02)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    asyncio.run(main(*sys.argv[1:]))
