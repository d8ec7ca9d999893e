"""A cluster view kept current by one watch: what nsqd and nsqlookupd read instead of etcd."""

from __future__ import annotations

import asyncio
from typing import Callable

import structlog

from . import keys
from .background import stop_task
from .etcd import Etcd, EtcdError, KeyValue, WatchLost
from .metadata import ClusterView, build_view

log = structlog.get_logger("isr.mirror")


class ClusterMirror:
    """Reads the whole cluster once, then applies the watch's events to its copy.

    `view` is rebuilt after each run of events (never in the middle of a transaction's
    events), `changed` is set and `on_change(view)` called after each rebuild. When etcd is
    unreachable the last view stays (`connected` False) and the watch resumes without a
    gap when etcd is back; when the watch is lost (compaction) it reads everything again.
    """

    def __init__(self, etcd: Etcd, cluster: str,
                 on_change: Callable[[ClusterView], None] | None = None):
        self.etcd = etcd
        self.cluster = cluster
        self.prefix = keys.cluster_prefix(cluster)
        # load reports change every few seconds and are no part of the view (the master
        # reads them on its own): skipped, so they never cost an apply pass anywhere
        self._loads = keys.load_prefix(cluster)
        self.on_change = on_change
        self.view: ClusterView | None = None
        self.ready = asyncio.Event()
        self.changed = asyncio.Event()
        self._kvs: dict[str, KeyValue] = {}
        self._decoded: dict = {}  # build_view's cache
        self._watch = None
        self._task: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        return self._watch is not None and self._watch.connected

    def start(self) -> "ClusterMirror":
        self._task = asyncio.create_task(self._run(), name=f"mirror {self.prefix}")
        return self

    async def close(self) -> None:
        await stop_task(self._task)

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                kvs, revision = await self.etcd.get_prefix(self.prefix)
                self._kvs = {kv.key: kv for kv in kvs if not kv.key.startswith(self._loads)}
                self._decoded = {}
                self._rebuild(revision)
                failing = False
                async with self.etcd.watch_prefix(self.prefix, revision + 1) as watch:
                    self._watch = watch
                    changed = False
                    async for event in watch:
                        if not event.kv.key.startswith(self._loads):
                            if event.type == "put":
                                self._kvs[event.kv.key] = event.kv
                            else:
                                self._kvs.pop(event.kv.key, None)
                                self._decoded.pop(event.kv.key, None)
                            changed = True
                            revision = event.kv.mod_revision
                        if watch.pending() == 0 and changed:
                            self._rebuild(revision)
                            changed = False
            except (EtcdError, WatchLost) as e:
                if not failing:
                    log.warning("mirror_resync", prefix=self.prefix, error=str(e))
                failing = True
                await asyncio.sleep(0.2)
            finally:
                self._watch = None

    def _rebuild(self, revision: int) -> None:
        view = build_view(self.cluster, self._kvs.values(), revision, self._decoded)
        if self.view is None or view.problems != self.view.problems:
            for problem in view.problems:
                log.warning("bad_metadata", problem=problem)
        self.view = view
        self.ready.set()
        self.changed.set()
        if self.on_change is not None:
            self.on_change(view)
