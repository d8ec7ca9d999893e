"""Worker: one thread that runs one queue's blocking file calls, in order.

Each DiskQueue has its own (one for writes, syncs and exclusive jobs, one for reads),
so a slow disk call of one partition never waits behind, or delays, another's.

Invariants:
- jobs run one at a time, in the order they were given;
- the thread starts with the first job and ends after `shutdown`, once the jobs given
  before it are done; no job is taken after `shutdown`;
- a job that raises is logged and never stops the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading

import structlog

log = structlog.get_logger("diskqueue")


class Worker(concurrent.futures.Executor):
    """`call(fn, *args)` is the write path's form: no future, the job reports back itself
    (one `SimpleQueue.put`, no Future, Condition or semaphore as `ThreadPoolExecutor.submit`
    makes). `submit` is the Executor interface, for `loop.run_in_executor` and aiofiles'
    `executor=`. Called from the event loop's thread only."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._shut = False

    def call(self, fn, *args) -> None:
        if self._shut:
            raise RuntimeError(f"worker {self.name} is shut down")
        self._put((fn, args))

    def _put(self, item) -> None:
        """Queue `item` for the thread, started by the first one."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put(item)

    def run(self, loop: asyncio.AbstractEventLoop, fn, *args) -> asyncio.Future:
        """fn(*args) on this worker; its result or exception comes in a future of `loop`.
        One queue put and one `call_soon_threadsafe`: no concurrent Future, no chaining
        (28 against 11 us a round trip, measured). A future cancelled before its job starts
        skips the job, as an executor's does."""
        fut = loop.create_future()

        def job() -> None:
            if fut.cancelled():
                return
            try:
                result = fn(*args)
            except BaseException as e:
                self.post(loop, _resolve, fut, None, e)
            else:
                self.post(loop, _resolve, fut, result, None)

        self.call(job)
        return fut

    def post(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        """From a job: have `loop` call fn(*args), whose last argument is the job's error
        or None. Posts reach the loop in the order they were made (the node journal's
        worker holds them until its round is synced: diskqueue/journal.py)."""
        loop.call_soon_threadsafe(fn, *args)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def job() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(result)

        self.call(job)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._shut:
            return
        self._shut = True
        if self._thread is not None:
            self._jobs.put(None)
            if wait:
                self._thread.join()

    def _run(self) -> None:
        get = self._jobs.get
        while (job := get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except BaseException:
                log.exception("worker_job_failed", worker=self.name)


def _resolve(fut: asyncio.Future, result, error) -> None:
    if not fut.done():
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)


class WorkerPool:
    """A node's read workers, shared by its queues: `pick(key)` gives the same Worker for
    the same key (so one queue's reads stay in order on one thread), and `size` threads
    serve any number of partitions (a thread each would cost a thread start on the loop
    and some 30 KB a partition: bench/scale.py)."""

    def __init__(self, name: str, size: int):
        self.workers = [Worker(f"{name}:{i}") for i in range(size)]

    def pick(self, key: str) -> Worker:
        return self.workers[hash(key) % len(self.workers)]

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown(wait=False)

