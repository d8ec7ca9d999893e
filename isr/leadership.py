"""A node's leader keys: `topics/<t>/p/<n>/leader` = its node id, under its registration's
lease, for every partition it leads (nsqlookupd/README.md, failover).

The keys say "this node is alive and serving this partition as leader": they go with the
registration's lease (a killed or cut-off node loses them with its node key), and the
nsqlookupd master moves the leadership of a partition whose leader key has been missing
for longer than the lease TTL. A node serves a partition as leader only while it holds
the key (`held`).

Invariants:
- a key is only ever created when absent, or re-attached to the current lease when it
  holds this node's own id; another node's key is never touched (not held: try later);
- `held` is empty as soon as the registration's lease is lost (before etcd can expire
  it): a node that cannot renew its lease holds nothing, at once;
- after the registration comes back under a new lease, every wanted key is written again
  under it (the old lease took them with it); a wanted key not held (another node's, etcd
  away) is tried again every RETRY_S.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

import structlog

from . import keys
from .background import stop_task
from .etcd import Etcd, EtcdError, absent, delete_op, put_op, value_is
from .registry import Registration

log = structlog.get_logger("isr.leadership")

Partition = tuple[str, int]
RETRY_S = 1.0  # a wanted key not held is tried again after this


def to_write(wanted: Iterable[Partition], held: dict[Partition, int],
             lease: int) -> list[Partition]:
    """Pure: the wanted partitions whose key is not held under `lease` (sorted)."""
    return sorted(p for p in wanted if held.get(p) != lease)


def held_under(held: dict[Partition, int], lease: int) -> frozenset[Partition]:
    """Pure: the partitions whose key was written under `lease` (none when lease is 0)."""
    return frozenset(p for p, at in held.items() if lease and at == lease)


class LeaderKeys:
    """The leader keys of node `node_id`, under `registration`'s lease.

    `await hold(partitions)` wants them held and writes the missing ones now: the set of
    them held; `release(partitions)` deletes them (step-down). `start()` runs the task
    that writes the wanted keys not held (at once after a re-registration, else every
    RETRY_S); `close()` stops it (the keys go with the registration's lease).
    """

    def __init__(self, etcd: Etcd, cluster: str, node_id: str, registration: Registration):
        self.etcd = etcd
        self.cluster = keys.check_cluster(cluster)
        self.node_id = keys.check_node_id(node_id)
        self.value = node_id.encode()
        self.registration = registration
        self.wanted: set[Partition] = set()
        self._held: dict[Partition, int] = {}  # partition -> the lease its key is under
        self._lock = asyncio.Lock()  # one writer at a time: hold, release, re-registration
        self._task: asyncio.Task | None = None

    @property
    def held(self) -> frozenset[Partition]:
        """The partitions whose key is held now (empty while the lease is lost)."""
        return held_under(self._held, self.registration.lease_id)

    def start(self) -> "LeaderKeys":
        self._task = asyncio.create_task(self._rewrite(), name=f"leader keys {self.node_id}")
        return self

    async def close(self) -> None:
        await stop_task(self._task)

    def want(self, partitions: Iterable[Partition]) -> None:
        """Want these keys held, written by the background task (within RETRY_S), not now:
        for partitions served whether or not the key is held (one replica)."""
        partitions = set(partitions)
        for topic, n in partitions:
            keys.partition_leader(self.cluster, topic, n)  # BadName if not a name
        self.wanted |= partitions

    async def hold(self, partitions: Iterable[Partition]) -> set[Partition]:
        """Want these keys held; write the ones not held under the current lease: the
        given partitions held now (etcd away or another node's key: not held)."""
        partitions = set(partitions)
        for topic, n in partitions:
            keys.partition_leader(self.cluster, topic, n)  # BadName if not a name
        self.wanted |= partitions
        async with self._lock:
            await self._write(to_write(partitions, self._held, self.registration.lease_id))
        return set(self.held & partitions)

    async def release(self, partitions: Iterable[Partition]) -> None:
        """Stop holding these keys and delete them (only while they hold this node's id)."""
        partitions = set(partitions)
        self.wanted -= partitions
        async with self._lock:
            for p in sorted(partitions):
                self._held.pop(p, None)
                key = keys.partition_leader(self.cluster, *p)
                try:
                    await self.etcd.txn([value_is(key, self.value)], [delete_op(key)])
                except EtcdError as e:  # it goes with the lease anyway
                    log.warning("leader_key_release_failed", key=key, error=str(e))
            if partitions:
                log.info("leader_keys_released", node=self.node_id, count=len(partitions))

    async def _write(self, partitions: list[Partition]) -> int:
        """Write these keys under the current lease: how many were written."""
        lease = self.registration.lease_id
        if not lease or not partitions:
            return 0
        taken, written = [], 0
        for p in partitions:
            key = keys.partition_leader(self.cluster, *p)
            try:
                ok, _ = await self.etcd.txn([absent(key)], [put_op(key, self.value, lease)])
                if not ok:  # ours under an older lease (or this one): re-attach it
                    ok, _ = await self.etcd.txn([value_is(key, self.value)],
                                                [put_op(key, self.value, lease)])
            except EtcdError as e:
                log.warning("leader_key_failed", key=key, error=str(e))
                return written
            if ok:
                self._held[p] = lease
                written += 1
            else:
                self._held.pop(p, None)
                taken.append(f"{p[0]}:{p[1]}")
        if taken:
            log.warning("leader_keys_held_by_others", node=self.node_id, partitions=taken[:10],
                        count=len(taken))
        return written

    async def _rewrite(self) -> None:
        """Write the wanted keys not held under the current lease: at once after each
        (re-)registration, else every RETRY_S."""
        while True:
            lease = self.registration.lease_id
            if lease and to_write(self.wanted, self._held, lease):
                async with self._lock:
                    written = await self._write(to_write(self.wanted, self._held, lease))
                if written:
                    log.info("leader_keys_written", node=self.node_id, lease=f"{lease:x}",
                             held=len(self.held), wanted=len(self.wanted))
            try:
                async with asyncio.timeout(RETRY_S):
                    await self.registration.next_lease(lease)
            except TimeoutError:
                pass
