"""A test host for isr's replication runtime: what nsqd does, with real DiskQueues, a real
RpcServer on 127.0.0.1, and an in-memory partition state with CAS (`States`) instead of
etcd. Also runnable as a child process holding one follower (for SIGSTOP tests):

    python repl_host.py PATH NODE_ID TOPIC PARTITION LEADER_ID LEADER_ADDRESS STATE_JSON

prints `ready <rpc port>` and serves until killed.
"""

from __future__ import annotations

import asyncio
import os
import sys

from diskqueue.queue import DiskQueue, QueueOptions
from isr.follower import FollowerLog
from isr.leader import LeaderLog
from isr.metadata import Conflict
from isr.peer import Peers
from isr.rpc import RpcServer
from isr.state import PartitionState

CLUSTER = "c1"


class States:
    """Partition states with etcd's CAS semantics; every change is told to each host."""

    def __init__(self):
        self.states: dict[tuple[str, int], PartitionState] = {}
        self.addresses: dict[str, str] = {}
        self.hosts: list[Host] = []
        self.changes = 0

    def put(self, topic: str, partition: int, state: PartitionState) -> PartitionState:
        old = self.states.get((topic, partition))
        state = state.evolve(revision=(old.revision if old else 0) + 1)
        self.states[(topic, partition)] = state
        for h in self.hosts:
            h.on_state(topic, partition, state)
        return state

    async def cas(self, topic, partition, expected, new) -> PartitionState:
        await asyncio.sleep(0.001)  # a round trip
        cur = self.states[(topic, partition)]
        if cur.revision != expected.revision:
            raise Conflict(f"{topic}/{partition}: revision {cur.revision} != {expected.revision}")
        self.changes += 1
        return self.put(topic, partition, new)


class Host:
    """One node: its queues, leader and follower logs, and its replication port."""

    def __init__(self, states: States, node_id: str, path: str, *, min_isr: int = 1,
                 repl_timeout: float = 1.0, sync=None):
        self.states = states
        self.cluster_id = CLUSTER
        self.node_id = node_id
        self.path = path
        self.min_isr = min_isr
        self.repl_timeout = repl_timeout
        self.sync = sync
        self.queues: dict[tuple[str, int], DiskQueue] = {}
        self.leaders: dict[tuple[str, int], LeaderLog] = {}
        self.followers: dict[tuple[str, int], FollowerLog] = {}
        self.channels: dict[tuple[str, int], dict] = {}
        self.peers = Peers(self)
        self.rpc = RpcServer(self, "127.0.0.1:0")
        states.hosts.append(self)

    # the host interface (isr/README.md)
    def leader_log(self, topic, partition):
        return self.leaders.get((topic, partition))

    def follower_log(self, topic, partition):
        return self.followers.get((topic, partition))

    def peer_address(self, node_id):
        return self.states.addresses.get(node_id)

    async def change_isr(self, topic, partition, expected, new):
        return await self.states.cas(topic, partition, expected, new)

    async def read_state(self, topic, partition):
        await asyncio.sleep(0.001)  # a round trip
        return self.states.states.get((topic, partition))

    def channels_received(self, topic, partition, channels):
        self.channels[(topic, partition)] = channels

    async def channel_states(self, topic, partition):
        return dict(self.channels.get((topic, partition), {}))

    # lifecycle
    async def start(self) -> Host:
        await self.rpc.start()
        self.states.addresses[self.node_id] = f"127.0.0.1:{self.rpc.port}"
        return self

    async def open(self, topic: str, partition: int, q: DiskQueue | None = None):
        """Open the partition's queue and lead or follow it as its state says."""
        if q is None:
            opts = QueueOptions(partition=partition, replicated=True)
            if self.sync is not None:
                opts = QueueOptions(partition=partition, replicated=True, sync=self.sync)
            q = await DiskQueue.open(os.path.join(self.path, topic, str(partition)), opts)
        self.queues[(topic, partition)] = q
        state = self.states.states[(topic, partition)]
        if state.leader == self.node_id:
            self.leaders[(topic, partition)] = await LeaderLog(
                self, self.peers, topic, partition, q, state, min_isr=self.min_isr,
                repl_timeout=self.repl_timeout).start()
            await self.leaders[(topic, partition)].taken()
        else:
            f = await FollowerLog(self, self.peers, topic, partition, q).open()
            self.followers[(topic, partition)] = f
            f.follow(state)
        return q

    async def lead(self, topic: str, partition: int) -> LeaderLog:
        """Failover: this node's follower of the partition becomes its leader."""
        follower = self.followers.pop((topic, partition))
        await follower.close()
        q = self.queues[(topic, partition)]
        leader = self.leaders[(topic, partition)] = await LeaderLog(
            self, self.peers, topic, partition, q, self.states.states[(topic, partition)],
            min_isr=self.min_isr, repl_timeout=self.repl_timeout).start()
        await leader.taken()
        return leader

    def publish(self, bodies, topic: str = "t", partition: int = 0):
        """A publish to a partition led here, through its LeaderLog's writer: a future of
        its Appended, answered once committed."""
        return self.leaders[(topic, partition)].writer.append(bodies)

    def on_state(self, topic, partition, state) -> None:
        leader = self.leaders.get((topic, partition))
        if leader is not None:
            leader.update_state(state)
        follower = self.followers.get((topic, partition))
        if follower is not None:
            follower.follow(state)

    async def stop(self) -> None:
        if self in self.states.hosts:
            self.states.hosts.remove(self)
        await self.rpc.stop()
        for log in [*self.leaders.values(), *self.followers.values()]:
            await log.close()
        await self.peers.close()
        for q in self.queues.values():
            await q.close()


async def _child(path, node_id, topic, partition, leader_id, leader_address, state_json):
    states = States()
    states.addresses[leader_id] = leader_address
    states.states[(topic, int(partition))] = PartitionState.decode(state_json.encode())
    host = await Host(states, node_id, path).start()
    await host.open(topic, int(partition))
    print("ready", host.rpc.port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    import structlog
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    asyncio.run(_child(*sys.argv[1:]))
