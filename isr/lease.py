"""A lease kept alive by a task of its own, and told lost before etcd may expire it."""

from __future__ import annotations

import asyncio

import structlog

from .etcd import Etcd, EtcdError, EtcdUnavailable, LeaseGone

log = structlog.get_logger("isr.lease")


class KeptLease:
    """Grant with `grant()`, then a task refreshes it every ttl/3 (sooner after a failure).

    Invariant: `lost` is set no later than etcd could have expired the lease (each refresh
    counts its TTL from before it was sent), so a holder that stops acting on `lost` never
    acts on an expired lease; a lost lease is never used again: grant a new one.
    """

    def __init__(self, etcd: Etcd, ttl: int):
        self.etcd = etcd
        self.ttl = ttl
        self.id = 0
        self.lost = asyncio.Event()
        self._expires = 0.0
        self._task: asyncio.Task | None = None

    async def grant(self) -> int:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        self.id = await self.etcd.grant(self.ttl)
        self._expires = sent + self.ttl
        self._task = asyncio.create_task(self._keepalive(), name=f"lease {self.id:x}")
        return self.id

    async def _keepalive(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.ttl / 3
        retry = min(interval, 0.25)
        wait = interval
        while True:
            await asyncio.sleep(max(0.0, min(wait, self._expires - loop.time())))
            remaining = self._expires - loop.time()
            if remaining <= 0:
                break
            sent = loop.time()
            try:
                async with asyncio.timeout(remaining):
                    ttl = await self.etcd.refresh(self.id)
                self._expires = sent + ttl
                wait = interval
            except LeaseGone:
                break
            except (EtcdUnavailable, TimeoutError):
                wait = retry
            except EtcdError as e:
                log.warning("lease_refresh_refused", lease=f"{self.id:x}", error=str(e))
                wait = retry
        log.warning("lease_lost", lease=f"{self.id:x}", ttl=self.ttl)
        self.lost.set()

    async def revoke(self) -> None:
        """Stop refreshing and end the lease in etcd (best effort: it expires anyway)."""
        if self._task is not None:
            self._task.cancel()
        self.lost.set()
        if self.id:
            try:
                await self.etcd.revoke(self.id)
            except EtcdError as e:
                log.info("lease_revoke_failed", lease=f"{self.id:x}", error=str(e))
