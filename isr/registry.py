"""A node's (or an nsqlookupd's) registration: its key, held under a lease while it runs."""

from __future__ import annotations

import asyncio

import structlog

from .background import stop_task
from .etcd import Etcd, EtcdError
from .lease import KeptLease

log = structlog.get_logger("isr.registry")


class Registration:
    """Keeps `key` = `value` in etcd, under a lease of `ttl` seconds, until `close()`.

    When etcd is unreachable it keeps trying (one log line per outage, `last_error` says
    why); when the lease is lost it registers again under a new lease. `registered` is set
    while the key is known to be there, and `lease_id` is then the lease it is held under
    (0 otherwise): other keys that must live and die with the registration (an nsqd's
    leader keys) go under it, and `next_lease` says when they must be written again.
    `close()` revokes the lease, so the key goes at once; a process killed outright leaves
    it to expire after the TTL.
    """

    def __init__(self, etcd: Etcd, key: str, value: bytes, ttl: int = 5):
        self.etcd = etcd
        self.key = key
        self.value = value
        self.ttl = ttl
        self.registered = asyncio.Event()
        self._changed = asyncio.Event()  # pulsed at each registration and each loss
        self.last_error: str | None = None
        self._lease: KeptLease | None = None
        self._task: asyncio.Task | None = None
        self._revokes: set[asyncio.Task] = set()

    def start(self) -> "Registration":
        self._task = asyncio.create_task(self._run(), name=f"registration {self.key}")
        return self

    async def wait_registered(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self.registered.wait()
            return True
        except TimeoutError:
            return False

    @property
    def lease_id(self) -> int:
        """The lease the key is held under now; 0 while not registered, and from the very
        moment the lease is declared lost (before etcd may expire it)."""
        lease = self._lease
        if not self.registered.is_set() or lease is None or lease.lost.is_set():
            return 0
        return lease.id

    async def next_lease(self, after: int = 0) -> int:
        """Wait until registered under a lease other than `after`: its id (the
        "registered again" signal: `after` = the lease whose keys are gone)."""
        while not (self.registered.is_set() and self.lease_id not in (0, after)):
            await self._changed.wait()
        return self.lease_id

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def update(self, value: bytes) -> None:
        """A new value, written now if registered (else at the next registration)."""
        self.value = value
        lease = self._lease
        if self.registered.is_set() and lease is not None:
            try:
                await self.etcd.put(self.key, value, lease.id)
            except EtcdError as e:
                log.warning("registration_update_failed", key=self.key, error=str(e))

    async def close(self) -> None:
        await stop_task(self._task)
        self.registered.clear()
        self._pulse()
        if self._lease is not None:
            await self._lease.revoke()
            self._lease = None
        log.info("unregistered", key=self.key)

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            lease = KeptLease(self.etcd, self.ttl)
            try:
                await lease.grant()
                self._lease = lease
                await self.etcd.put(self.key, self.value, lease.id)
            except EtcdError as e:
                if lease.id:
                    await lease.revoke()
                if self.last_error is None:
                    log.error("registration_failing", key=self.key, error=str(e),
                              endpoints=[f"{h}:{p}" for _, h, p in self.etcd.endpoints])
                self.last_error = str(e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, max(0.5, self.ttl / 4))
                continue
            backoff = 0.1
            self.last_error = None
            self.registered.set()
            self._pulse()
            log.info("registered", key=self.key, lease=f"{lease.id:x}", ttl=self.ttl)
            await lease.lost.wait()
            self.registered.clear()
            self._pulse()
            log.warning("registration_lost", key=self.key, lease=f"{lease.id:x}")
            revoke = asyncio.create_task(lease.revoke())  # in case etcd still has it
            self._revokes.add(revoke)
            revoke.add_done_callback(self._revokes.discard)
