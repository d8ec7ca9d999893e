"""A child process for tests/test_isr_cluster.py: registers a key, or campaigns for a master
key, prints `ready` once it holds it (or runs), then waits to be killed.

    python isr_holder.py register ENDPOINT KEY VALUE TTL
    python isr_holder.py elect ENDPOINT KEY MY_ID TTL
"""

import asyncio
import sys

import structlog

from isr.election import Election
from isr.etcd import Etcd
from isr.registry import Registration


async def main(mode: str, endpoint: str, key: str, value: str, ttl: str) -> None:
    etcd = Etcd(endpoint, timeout=1)
    if mode == "register":
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
