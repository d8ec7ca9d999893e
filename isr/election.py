"""One master among candidates: the holder of a key created under its lease."""

from __future__ import annotations

import asyncio
from typing import Callable

import structlog

from .background import stop_task
from .etcd import Etcd, EtcdError, WatchLost
from .lease import KeptLease

log = structlog.get_logger("isr.election")


class Election:
    """Campaigns for `key` with the value `my_id` until `close()`.

    The master is whoever created the key: `create` if absent under its own lease. The
    others watch the key and campaign again as soon as it is deleted, which etcd does
    when the master's lease expires (a killed master is replaced within the TTL) or is
    revoked (`close()`: a clean hand-over, at once). A master whose lease may have expired
    (etcd unreachable for the TTL) stops being master at that moment, before etcd could
    let another take over. `on_change(is_master, master_id)` and the `changed` event
    (set at each change, cleared by the caller) report every change.
    """

    def __init__(self, etcd: Etcd, key: str, my_id: str, ttl: int = 5,
                 on_change: Callable[[bool, str | None], None] | None = None):
        self.etcd = etcd
        self.key = key
        self.my_id = my_id
        self.ttl = ttl
        self.on_change = on_change
        self.is_master = False
        self.master_id: str | None = None
        self.changed = asyncio.Event()
        self._lease: KeptLease | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> "Election":
        self._task = asyncio.create_task(self._run(), name=f"election {self.key}")
        return self

    async def close(self) -> None:
        """Stop campaigning; a master resigns (its key goes with its lease)."""
        await stop_task(self._task)
        self._set(False, None if self.is_master else self.master_id)
        if self._lease is not None:
            await self._lease.revoke()
            self._lease = None

    def _set(self, is_master: bool, master_id: str | None) -> None:
        if (is_master, master_id) == (self.is_master, self.master_id):
            return
        self.is_master, self.master_id = is_master, master_id
        log.info("master_changed", key=self.key, master=master_id, is_master=is_master,
                 me=self.my_id)
        self.changed.set()
        if self.on_change is not None:
            self.on_change(is_master, master_id)

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                if self._lease is None or self._lease.lost.is_set():
                    self._set(False, None if self.is_master else self.master_id)
                    self._lease = KeptLease(self.etcd, self.ttl)
                    await self._lease.grant()
                await self.etcd.create(self.key, self.my_id.encode(), self._lease.id)
                kv, revision = await self.etcd.get(self.key)
                if kv is None:
                    continue  # deleted between the two calls: campaign again
                mine = kv.lease == self._lease.id
                self._set(mine, kv.value.decode("utf-8", "replace"))
                failing = False
                await self._until_changed(revision + 1)
            except (EtcdError, WatchLost) as e:
                if not failing:
                    log.warning("election_failing", key=self.key, error=str(e))
                failing = True
                await asyncio.sleep(0.2)

    async def _until_changed(self, start_revision: int) -> None:
        """Return when the key is put or deleted, or when our lease is lost."""
        lease = self._lease
        assert lease is not None
        async with self.etcd.watch(self.key, start_revision=start_revision) as watch:
            event = asyncio.ensure_future(watch.__anext__())
            lost = asyncio.ensure_future(lease.lost.wait())
            try:
                await asyncio.wait((event, lost), return_when=asyncio.FIRST_COMPLETED)
            finally:
                event.cancel()
                lost.cancel()
            if event.done() and not event.cancelled() and event.exception() is not None:
                raise event.exception()
