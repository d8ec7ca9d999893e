"""NSQD: the data node. Owns the topics of this node, their metadata, and the
background loops (timeouts, checkpoints, retention); starts and stops the TCP
and HTTP servers and, in cluster mode, the cluster driver: main.build hands it all three.

Lifecycle: `await start()` opens every stored topic and channel and listens; in cluster
mode publishes wait (`serving`) until the first view of etcd is applied, START_GRACE_S at
most: a topic deleted or made again in etcd while the node was down never takes a
publish into the data it held (acknowledged there, then closed or deleted by the view);
`await stop()` stops accepting, closes client connections (their in-flight
messages go back to their channels), writes what is pending, persists every
cursor, and closes the logs.

Faults stay inside their partition (topic.py): a partition that does not open is
reported (log, /stats, /metrics, /ping) and refuses publishes while the rest of the
node serves; `reopen` tries it again without a restart. A topic or channel that cannot
be made (a full disk) is not made at all: StorageError, and nothing half-made remains.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time

import structlog

from diskqueue.atomic import make_dirs
from diskqueue.journal import Journal
from diskqueue.queue import QueueOptions
from diskqueue.worker import WorkerPool

from .assignment import Assignment
from .channel import Channel
from .errors import NameError_, PartitionNotWritable, StorageError, TopicConflict, TopicNotFound
from .health import DiskWatch, FailureLog, node_health
from .lookup import Lookup
from .metastore import MetaStore, channel_key, topic_key
from .openlogs import OpenLogs
from .options import Options
from nsqwire.protocol import valid_channel_name, valid_topic_name
from .timeouts import TimeoutScan
from .tracing import Tracer
from .topic import TOMBSTONE, Topic, bury, buried_path, remove_grave, sync_policy, topic_folder

log = structlog.get_logger("nsqd")

VERSION = "1.3.0"
SCAN_INTERVAL = 0.1
OPEN_AT_ONCE = 16  # partitions a start opens at a time (over all topics)
READ_WORKERS = 8  # threads for every partition's read-ahead (diskqueue.worker.WorkerPool)
# Cluster mode: the longest publishes wait at start for the first view of etcd to be
# applied; etcd away that long, they go to the assignment the last run stored.
START_GRACE_S = 2.0
# sqlitedict logs each failed statement itself, as a multi-line traceback, then raises it
# to us: on a full disk that was ~80 lines a second. Its errors reach us; we log them.
logging.getLogger("sqlitedict").setLevel(logging.CRITICAL)


def find_tombstones(data_path: str) -> list[tuple[str, str, int | None, str | None]]:
    """(tombstone, topic, partition, channel) of every buried topic folder and channel delay
    store under `data_path` (see topic.bury); partition and channel are None for a topic."""
    out = []
    for entry in os.scandir(data_path):
        if entry.name.endswith(TOMBSTONE):
            name = os.path.basename(buried_path(entry.path))
            if name.endswith(".topic"):
                out.append((entry.path, name[:-len(".topic")], None, None))
        elif entry.name.endswith(".topic") and entry.is_dir():
            for part in os.scandir(entry.path):
                delay = os.path.join(part.path, "delay")
                if not part.name.isdigit() or not os.path.isdir(delay):
                    continue
                for store in os.scandir(delay):
                    name = os.path.basename(buried_path(store.path))
                    if store.name.endswith(TOMBSTONE) and name.endswith(".channel"):
                        out.append((store.path, entry.name[:-len(".topic")], int(part.name),
                                    name[:-len(".channel")]))
    return out


def single_segment(queue) -> bool:
    """Whether the log is its active segment alone, which retention never drops: then the
    retention loop skips it without a job on its write worker. (A segment made meanwhile
    waits for the next check.)"""
    return queue.segment_count == 1


class NSQD:
    def __init__(self, options: Options, *, start_tcp, start_http, make_cluster):
        """`start_tcp`, `start_http`: async (node) -> (server, port), each listener;
        `make_cluster`: (node) -> the cluster driver, made in cluster mode
        (--etcd-endpoints). main.build passes tcp.py's, http.py's and cluster.Cluster."""
        self.options = options
        self._start_tcp, self._start_http, self._make_cluster = start_tcp, start_http, make_cluster
        self.topics: dict[str, Topic] = {}
        self.start_time = time.time()
        self.checkpoint_failures = FailureLog(log, "checkpoint_failed")
        self.journal: Journal | None = None  # opened by start() (none with --journal false)
        self.open_logs = OpenLogs()  # openlogs.py: logs with files open, and their release
        self.read_workers = WorkerPool("diskqueue:read", READ_WORKERS)  # every log's reads
        self.disk = DiskWatch(options.data_path)  # read by /ping, /stats, /metrics
        self.walking = asyncio.Lock()  # a /stats or /metrics walk of every partition (statshttp.py)
        self.metrics_sending = asyncio.Lock()  # a /metrics answer being sent (statshttp.py)
        self.meta: MetaStore | None = None
        self._create_lock = asyncio.Lock()
        self._unsaved: set[Channel] = set()  # made by _create_channel, not on disk yet
        self._topic_states: dict[str, dict] = {}  # the state of each topic put last
        self._changed: set[Channel] = set()  # channels changed since the last checkpoint
        self._tasks: list[asyncio.Task] = []
        self.tcp_server = None
        self.http_runner = None
        self.tcp_port = 0
        self.http_port = 0
        self.connections: set = set()
        self._next_client_id = 0
        self._stopping = False
        self.version = VERSION
        self.clock = time.time  # wall clock of due times; tests inject their own
        self.timeouts = TimeoutScan()  # the channels something may come due in
        self.lookup = Lookup(self)  # the nsqlookupd peers, dialled once the node listens
        self.cluster = None  # cluster.Cluster in cluster mode (--etcd-endpoints)
        self.serving = asyncio.Event()  # publishes are taken (cluster mode: see start)
        self.tracer = Tracer(self)  # message trace (tracing.py): switches, events, store

    @property
    def health(self) -> str:
        """`OK`, or `NOK - <reasons>` (health.node_health)."""
        return node_health(self)

    # ---- lifecycle -------------------------------------------------------

    def queue_options(self, sync: tuple[int, int] | None = None) -> QueueOptions:
        """Options of a topic's partitions: the node's sync policy, or the topic's own
        (`sync`: messages per sync, ms; see Topic.sync), and its commit timeout. In cluster
        mode every partition is a replicated log, whatever its replica count (one replica:
        an ISR of its leader alone, which commits on its own write), so a replica can be
        added to any partition and moved like any other."""
        o = self.options
        every, ms = sync or (o.sync_every, o.sync_timeout_ms)
        return QueueOptions(segment_bytes=o.segment_bytes, sync=sync_policy(every, ms),
                            commit_timeout=o.commit_timeout_ms / 1000,
                            replicated=bool(o.etcd_endpoints), journal=self.journal,
                            files=self.open_logs.files, read_workers=self.read_workers)

    def channel_settings(self) -> dict:
        o = self.options
        return {"max_window": o.max_channel_window, "delay_threshold_ms": o.delay_threshold_ms,
                "max_attempts_in_memory": o.delay_after_attempts, "clock": self.clock,
                "confirm_fin": self.replicate_channel, "timeouts": self.timeouts,
                "changed": self._changed}

    async def replicate_channel(self, channel: Channel) -> None:
        """The channel's state to every ISR follower of its replicated partition now;
        returns once they all stored it. For an ordered channel's FIN (nsqd/ordered.py) and
        an admin change (replay, pause, empty, setorder). NotWritable: not led here."""
        part = channel.topic.partitions.get(channel.partition)
        if part is None:
            raise PartitionNotWritable(f"partition {channel.partition} is not open here")
        await part.writer.push_channel(channel)

    async def start(self) -> None:
        await asyncio.to_thread(make_dirs, self.options.data_path)
        if self.options.journal:  # replayed before any partition opens
            self.journal = await asyncio.to_thread(Journal.open, self.options.data_path,
                                                   self.options.journal_checkpoint_bytes)
        self.meta = MetaStore(os.path.join(self.options.data_path, "nsqd.meta.sqlite"))
        await self._finish_deletes()
        await asyncio.to_thread(self.tracer.start, self.meta)
        stored = await asyncio.to_thread(self.meta.topics)
        channels = await asyncio.to_thread(self.meta.all_channels)
        at_once = asyncio.Semaphore(OPEN_AT_ONCE)
        opened = await asyncio.gather(*(
            self._open_topic(name, state, channels=channels.get(name, {}), at_once=at_once)
            for name, state in stored.items()))
        self.topics.update(zip(stored, opened))
        self.tcp_server, self.tcp_port = await self._start_tcp(self)
        self.tracer.start_writer(self.tcp_port)
        self.http_runner, self.http_port = await self._start_http(self)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._scan_loop()),
                       loop.create_task(self._checkpoint_loop()),
                       loop.create_task(self._retention_loop()),
                       loop.create_task(self.open_logs.release_loop())]
        self.lookup.set_addresses(self.options.lookupd_tcp_address)
        if self.options.etcd_endpoints:
            self.cluster = self._make_cluster(self)
            await self.cluster.start()
            self._tasks.append(loop.create_task(self._serve_when_applied()))
        else:
            self.serving.set()
        log.info("started", tcp_port=self.tcp_port, http_port=self.http_port,
                 data_path=self.options.data_path, topics=len(self.topics))

    async def _serve_when_applied(self) -> None:
        try:
            async with asyncio.timeout(START_GRACE_S):
                await self.cluster.first_applied.wait()
        except TimeoutError:
            log.warning("serving_stored_assignment", waited_s=START_GRACE_S,
                        reason="no view of etcd applied yet")
        self.serving.set()

    async def stop(self) -> bool:
        """Stop as cleanly as the disk allows: every step is tried even when one before it
        failed (a full disk fails the checkpoints, not the closing of the logs). Returns
        False, after one `stopped_with_errors` line naming what failed, when something
        could not be persisted (the cursors then lag: duplicates after the restart)."""
        if self._stopping:
            return True
        self._stopping = True
        if self.cluster is not None:  # leaves the cluster at once: its lease is revoked
            await self.cluster.stop()
        await self.lookup.stop()  # lookups stop pointing consumers here while it drains
        self.tcp_server.close()
        for conn in list(self.connections):
            conn.close()
        await self.http_runner.cleanup()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        failed = []

        async def attempt(step: str, fn) -> None:
            try:
                await fn()
            except Exception as e:
                failed.append(f"{step}: {type(e).__name__}: {e}")

        await attempt("checkpoint", self.checkpoint)
        for topic in list(self.topics.values()):
            await topic.close()  # never raises: what fails is logged per partition
        await attempt("checkpoint", self.checkpoint)
        await attempt("metadata close", lambda: asyncio.to_thread(self.meta.close))
        if self.journal is not None:  # after every partition: they were its writers
            await attempt("journal close", lambda: asyncio.to_thread(self.journal.close))
        self.read_workers.shutdown()
        await self.tracer.close()  # what it could not write in 10 s is lost: events only
        if failed:
            log.error("stopped_with_errors", errors=failed)
            return False
        log.info("stopped")
        return True

    def next_client_id(self) -> int:
        self._next_client_id += 1
        return self._next_client_id

    # ---- topics and channels ---------------------------------------------

    async def _open_topic(self, name: str, state: dict, create: bool = False, *,
                          channels: dict | None = None,
                          at_once: asyncio.Semaphore | None = None) -> Topic:
        """Open a topic and its channels (not yet in `self.topics`); a partition that fails
        is held in `topic.failed` (see topic.py). `channels`: its stored channels (as
        MetaStore.channels; read here when None); `at_once`: see Topic.open."""
        path = topic_folder(self.options.data_path, name)
        sync = state.get("sync")
        topic = Topic(name, path, self.queue_options(tuple(sync) if sync else None))
        self.tracer.attach(topic)
        topic.sync = tuple(sync) if sync else None
        topic.retention_ms = state.get("retention_ms")
        topic.half_check = (self.options.half_check_timeout_ms / 1000, self.options.half_check_max)
        if topic.ephemeral:  # never stored: what a run before this one left is not ours
            await asyncio.to_thread(shutil.rmtree, path, True)
            create = True
        topic.paused = state.get("paused", False)
        assignment = Assignment.from_state(state.get("assignment"))
        topic.set_assignment(assignment)
        await topic.open(sorted(assignment.leading), state.get("floors", {}), create, at_once)
        await self._add_channels(topic, list(topic.partitions), channels)
        return topic

    async def _add_channels(self, topic: Topic, partitions: list[int],
                            channels: dict | None = None) -> None:
        """Open the stored channels of these (open) partitions at their saved cursors
        (`channels`: the topic's stored ones, as MetaStore.channels; read when None)."""
        if channels is None:
            channels = await asyncio.to_thread(self.meta.channels, topic.name)
        partitions = set(partitions)
        settings = self.channel_settings()
        for (partition, channel_name), cstate in channels.items():
            p = topic.partitions.get(partition)
            if p is not None and partition in partitions:
                p.add_channel(channel_name, cstate, **settings)

    async def get_topic(self, name: str, create: bool = True) -> Topic | None:
        """The topic; `create`: auto-create it (one partition, led here) when missing,
        unless --disable-auto-create (then None, as for create=False). In cluster mode a
        missing topic is the one etcd has, or one made there (cluster.py; raises
        ClusterUnavailable)."""
        topic = self.topics.get(name)
        if topic is not None or not create:
            return topic
        if self.cluster is not None:
            if not valid_topic_name(name):
                raise NameError_(name)
            return await self.cluster.topic(name, not self.options.disable_auto_create)
        if self.options.disable_auto_create:
            return None
        if not valid_topic_name(name):
            raise NameError_(name)
        async with self._create_lock:
            topic = self.topics.get(name)
            if topic is None:
                topic = await self._create_topic(name, Assignment.single())
        return topic

    async def until_led(self, topic: Topic, partition: int | None) -> None:
        """Wait, at most the commit timeout, while a publish to `partition` (None: any)
        finds no writable partition only because a leadership here is starting (a topic
        just made, a partition just taken over: Topic.starting); at once before a cluster
        node applied a view of etcd (etcd away at start: no leadership is on its way)."""
        if self.cluster is not None and not self.cluster.first_applied.is_set():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.commit_timeout_ms / 1000
        while topic.starting(partition) and loop.time() < deadline:
            await asyncio.sleep(0.005)

    async def create_topic(self, name: str, partition_num: int | None = None,
                           ordered: bool = False) -> Topic:
        """POST /topic/create: the topic with `partition_num` partitions, all led here
        (None: an existing topic as it is, a new one with one). Raises TopicConflict when
        it exists with another count, AssignmentError for a count out of range. In
        cluster mode the topic is made in etcd (cluster.py; an ordered one through nsqlookupd).
        `ordered`: a new topic takes only SUB_ORDERED and keyed publishes (ordered.py)."""
        if not valid_topic_name(name):
            raise NameError_(name)
        if self.cluster is not None:
            return await self.cluster.create_topic(name, partition_num)
        assignment = Assignment.all_led(partition_num or 1).with_(ordered=ordered)
        async with self._create_lock:
            topic = self.topics.get(name)
            if topic is None:
                return await self._create_topic(name, assignment)
        have = topic.assignment.partition_num
        if partition_num is not None and have != partition_num:
            raise TopicConflict(f"topic {name} exists with partition_num {have}, "
                                f"not {partition_num}")
        if ordered and not topic.assignment.ordered:
            raise TopicConflict(f"topic {name} exists and is not ordered")
        return topic

    async def _create_topic(self, name: str, assignment: Assignment) -> Topic:
        """Make a topic with its led partitions: on disk and in the metadata (flushed)
        before anyone may publish to it (it joins `self.topics` last), or not at all
        (StorageError, nothing left)."""
        topic = await self._open_topic(name, {"assignment": assignment.state()}, create=True)
        error = next(iter(topic.failed.values()), None)
        if error is None:
            try:
                self._store_topic(topic)
                await self.meta.flush()
            except Exception as e:
                self._forget_topic(name)
                error = f"storing its metadata failed: {type(e).__name__}: {e}"
        if error is not None:
            await topic.close()
            await asyncio.to_thread(shutil.rmtree, topic.path, True)
            log.error("topic_create_failed", topic=name, error=error)
            raise StorageError(f"topic {name} could not be created: {error}")
        self.topics[name] = topic
        self.lookup.topic_created(name)
        log.info("topic_created", topic=name)
        return topic

    async def get_channel(self, topic_name: str, channel_name: str,
                          partition: int | None = None, create: bool = True,
                          register: bool = True) -> Channel | None:
        """The channel of a partition (None: the topic's first), made when missing. In
        cluster mode a new channel is created in etcd first (`register`; the cluster
        driver, which makes the channels etcd has, passes False); made here, it starts
        where `_start_without_state` says. The caller of a cluster-wide create waits for
        every partition's leader after (Cluster.wait_made)."""
        while True:
            topic = await self.get_topic(topic_name, create)
            if topic is None:
                return None
            p = topic.partition(partition)
            if p is None:
                number = 0 if partition is None else partition
                if number in topic.failed:
                    raise StorageError(f"topic {topic_name} partition {number} does not serve: "
                                       f"{topic.failed[number]}")
                return None
            channel = p.channels.get(channel_name)
            if channel is not None or not create:
                return channel
            if not valid_channel_name(channel_name):
                raise NameError_(channel_name)
            if self.cluster is not None and register:
                await self.cluster.ensure_channel(topic_name, channel_name)
            async with self._create_lock:  # waits for a delete of this channel or topic
                if self.topics.get(topic_name) is not topic:
                    continue  # deleted meanwhile: the channel goes to its successor
                channel = p.channels.get(channel_name)
                if channel is None:
                    start = None
                    local = register and (self.cluster is None or channel_name.endswith(
                        "#ephemeral"))  # this node's alone: at the end, as classic nsqd
                    if not local and p.channels:  # see the docstring
                        start = await self._start_without_state(p, topic_name, channel_name)
                    channel = await self._create_channel(topic, p, channel_name, start)
                    if self.cluster is not None:
                        self.cluster.channel_made(p, channel)
                return channel

    async def _start_without_state(self, p, topic: str, channel: str) -> tuple[int, int] | None:
        """Where a channel this partition has no state of starts (a partition's first
        channel starts at the floor anyway: Partition.add_channel). Cluster mode: where
        Cluster.start_of says (the committed end when etcd made the channel while this
        node led the partition, else the floor: never skip); never from a clock. Else at
        the floor of a replicated partition, or at the end (None)."""
        if self.cluster is not None:
            return self.cluster.start_of(topic, p, channel)
        return p.floor if p.queue.options.replicated else None

    async def _create_channel(self, topic: Topic, p, name: str,
                              start: tuple[int, int] | None = None) -> Channel:
        """Make a channel: its metadata on disk before SUB's OK (a channel lost in a crash
        would come back starting at the topic's end, past what was published for it in
        between), or not at all (StorageError)."""
        channel = p.add_channel(name, None, start, **self.channel_settings())
        self._unsaved.add(channel)
        try:
            self._store_channel(channel)
            await self.meta.flush()
        except Exception as e:  # not made at all: the SUB gets an error, not a channel
            await self._forget_new_channel(topic, p, channel)
            error = f"storing its metadata failed: {type(e).__name__}: {e}"
            log.error("channel_create_failed", topic=topic.name, partition=p.number,
                      channel=name, error=error)
            raise StorageError(f"channel {name} could not be created: {error}")
        finally:
            self._unsaved.discard(channel)
        self.lookup.channel_created(topic.name, name)
        log.info("channel_created", topic=topic.name, partition=p.number, channel=name)
        self._join_channel(topic, p, channel)
        return channel

    # A delete is crash-safe at every point and never shares files with what is made after
    # it: under the create lock, close, bury the folder (rename to a tombstone, fsync the
    # parent), forget the metadata (flushed), then remove the tombstone. A crash before the
    # rename leaves it whole; after it, start() finishes it (_finish_deletes). A topic or
    # channel of the same name made later waits for the lock and gets a fresh folder.

    def saved(self, channel: Channel) -> bool:
        """False while a channel made here waits for its metadata on disk (_create_channel):
        it is in its partition's channels, but not made yet (Cluster.made_here)."""
        return channel not in self._unsaved

    async def _forget_new_channel(self, topic: Topic, p, channel: Channel) -> None:
        if p.channels.get(channel.name) is channel:
            del p.channels[channel.name]
        self.meta.delete(channel_key(topic.name, p.number, channel.name))
        await channel.close()

    async def reopen(self, topic: Topic, number: int) -> str | None:
        """Open a partition again without restarting the node (POST /topic/reopen): its
        consumers are disconnected, the cursors saved (if the disk takes them), channels and
        log closed, the log opened again with recovery, the channels re-made at their saved
        cursors. Returns None when it serves again, else the reason (also in /stats)."""
        async with self._create_lock:
            p = topic.partitions.get(number)
            if p is not None:
                for c in p.channels.values():
                    self._disconnect_clients(c)
                try:
                    self._save_cursors(p)
                    await self.meta.flush()
                except Exception as e:  # the cursors of the last checkpoint are used
                    log.warning("reopen_checkpoint_failed", topic=topic.name, partition=number,
                                error=f"{type(e).__name__}: {e}")
                await topic.close_partition(number, "reopening")
            error = await topic.open_partition(number, None)
            if error is None:
                await self._add_channels(topic, [number])
                log.info("partition_reopened", topic=topic.name, partition=number)
            return error

    async def apply_assignment(self, name: str, partition_num: int, leading,
                               ordered: bool = False, ext: dict | None = None,
                               incarnation: int = 0) -> Topic:
        """Serve `leading` of the topic's `partition_num` partitions, without a restart (the
        cluster driver's call; tests call it in-process). A missing topic is made.

        Partitions taken away leave `writable` first (no publish reaches them; appends in
        flight are written before the log closes), then their consumers lose them: a
        subscriber of that one partition gets E_FAILED_ON_NOT_LEADER and is closed, an
        all-partitions subscriber keeps the others; their in-flight messages are not
        confirmed, so they come back from the checkpoint wherever the partition serves next.
        Then the channels and log close and the cursors are stored; data stays on disk.
        Partitions newly led open (their folders made durably), with their stored channels
        and every channel the topic has on its other partitions; they join `writable`, and
        every all-partitions subscription of the topic, only once the assignment is stored.
        Runs under the create lock (no topic or channel create or delete meanwhile).
        Raises AssignmentError (bad numbers), NameError_, or StorageError when the
        metadata could not be stored (it stays pending: the next checkpoint retries)."""
        assignment = Assignment(partition_num, frozenset(leading), ordered, dict(ext or {}),
                                incarnation)
        if not valid_topic_name(name):
            raise NameError_(name)
        async with self._create_lock:
            topic = self.topics.get(name)
            if topic is None:
                topic = await self._create_topic(name, assignment)
                log.info("assignment_applied", topic=name, partition_num=partition_num,
                         leading=sorted(assignment.leading), opened=sorted(topic.partitions))
                return topic
            held = {*topic.partitions, *topic.failed}
            gone = sorted(n for n in held if n not in assignment.leading)
            new = sorted(n for n in assignment.leading if n not in topic.partitions)
            topic.set_assignment(assignment.with_(leading=assignment.leading - set(new)))
            for n in gone:
                self._drop_consumers(topic, n)
            for n in gone:
                p = await topic.release_partition(n)
                if p is not None:
                    for channel in p.channels.values():
                        self._store_channel(channel)
            names = {c.name for c in topic.channels()} | {
                conn.client.channel_name for conn in self.connections
                if conn.client.all_partitions and conn.client.topic_name == name}
            for n in new:
                if n in topic.failed:  # held, but it did not open: try again
                    del topic.failed[n]
                error = await topic.open_partition(n, None, create=not topic.known_floor(n))
                if error is None:
                    await self._add_channels(topic, [n])
                    p = topic.partitions[n]
                    for channel_name in sorted(names - set(p.channels)):
                        start = await self._start_without_state(p, name, channel_name)
                        channel = p.add_channel(channel_name, None, start,
                                                **self.channel_settings())
                        self._store_channel(channel)
                        if self.cluster is not None:
                            self.cluster.channel_made(p, channel)
            topic.set_assignment(topic.assignment)  # still without `new`: stored first
            self._store_topic_as(topic, assignment)
            try:
                await self.meta.flush()
            finally:  # in memory as asked, even when the disk refused (it is retried)
                topic.set_assignment(assignment)
                self._join_subscriptions(topic, new)
            log.info("assignment_applied", topic=name, partition_num=partition_num,
                     leading=sorted(assignment.leading), opened=new, closed=gone)
            return topic

    def _store_topic_as(self, topic: Topic, assignment: Assignment) -> None:
        if not topic.ephemeral:
            self._put_topic(topic.name, {**topic.state(), "assignment": assignment.state()})

    def _drop_consumers(self, topic: Topic, number: int) -> None:
        """A partition is taken away: every consumer of it loses it now (see
        apply_assignment); its in-flight messages of it go back to the channel."""
        p = topic.partitions.get(number)
        if p is None:
            return
        for conn in list(self.connections):
            client = conn.client
            channel = client.channels.get(number)
            if channel is None or channel.topic is not topic:
                continue
            client.unsubscribe(channel)
            if not client.all_partitions:
                conn.lose_partition()

    def _join_subscriptions(self, topic: Topic, numbers: list[int]) -> None:
        """Partitions newly led: every all-partitions subscriber of the topic consumes them
        too (their channels were made by apply_assignment, or are made later)."""
        for n in numbers:
            p = topic.writable.get(n)
            for channel in (p.channels.values() if p is not None else ()):
                self._join_channel(topic, p, channel)

    def _join_channel(self, topic: Topic, p, channel: Channel) -> None:
        """A channel of a led partition: the topic's all-partitions subscribers of its name
        consume it. Called when either comes later than the other: a SUB answered while
        the node took the partition over subscribes to a channel made after it."""
        if topic.writable.get(p.number) is not p:
            return
        for conn in self.connections:
            client = conn.client
            if (client.all_partitions and client.topic_name == topic.name
                    and client.channel_name == channel.name and p.number not in client.channels):
                client.subscribe(channel)

    async def subscription(self, topic_name: str, channel_name: str,
                           partition: int | None) -> dict[int, Channel]:
        """The channels a SUB consumes (made when missing): of `partition`, or of every
        partition of the topic this node leads (None). The caller attaches the client
        before its next await: what is returned is current at return. Raises
        TopicNotFound, NameError_, what Topic.check_partition raises, and StorageError
        (also when no led partition serves but one failed). In cluster mode a SUB that
        makes the channel here (or leads nothing of the topic) answers only once every
        partition's leader made it (Cluster.wait_made; ClusterUnavailable after WAIT_S)."""
        waited = self.cluster is None or channel_name.endswith("#ephemeral")
        while True:
            topic = await self.get_topic(topic_name)
            if topic is None:
                raise TopicNotFound(topic_name)
            if partition is not None:
                topic.check_partition(partition)
            elif not topic.writable:  # a led partition that does not serve says why
                for n in sorted(topic.assignment.leading):
                    topic.check_partition(n)
            numbers = sorted(topic.writable) if partition is None else [partition]
            creating = not waited and (not numbers or any(
                channel_name not in topic.writable[n].channels
                for n in numbers if n in topic.writable))
            if not numbers and self.cluster is not None:
                # None led here (yet): the channel is etcd's all the same, so the partitions
                # this node leads later make it for the client (else they would drop it as
                # deleted in etcd, the client left subscribed to nothing)
                await self.cluster.ensure_channel(topic_name, channel_name)
            channels = {}
            for n in numbers:
                channel = await self.get_channel(topic_name, channel_name, n)
                if channel is not None:
                    channels[n] = channel
            if creating:  # then the channels again: what is returned is current at return
                await self.cluster.wait_made(topic_name, channel_name)
                waited = True
                continue
            if self.topics.get(topic_name) is not topic:
                continue  # deleted meanwhile
            if partition is not None:
                topic.check_partition(partition)  # taken away meanwhile?
            current = {n: p.channels.get(channel_name) for n, p in topic.writable.items()
                       if partition is None or n == partition}
            if current == channels:
                return channels

    def _save_cursors(self, p) -> None:
        for channel in p.channels.values():
            self._store_channel(channel)
        self._store_topic(p.topic)

    async def delete_topic(self, name: str) -> bool:
        async with self._create_lock:
            topic = self.topics.pop(name, None)
            if topic is None:
                return False
            for c in topic.channels():
                self._disconnect_clients(c)
            if topic.trace is not None:
                for p in topic.partitions.values():
                    self.tracer.range_dropped(name, p.number, "", p.queue.committed_end,
                                              "topic deleted")
            grave = await topic.close_and_bury()
            self._forget_topic(name)
            self.meta.delete_prefix(f"channel/{name}/")
            await self.meta.flush()
        self.lookup.topic_deleted(name)
        log.info("topic_deleted", topic=name)
        if grave is not None:  # a big topic: after the lock, so publishers need not wait
            await asyncio.to_thread(remove_grave, grave)
        return True

    async def delete_channel(self, topic_name: str, channel_name: str,
                             partition: int | None = None) -> bool:
        async with self._create_lock:
            topic = self.topics.get(topic_name)
            p = topic.partition(partition) if topic else None
            if p is None or channel_name not in p.channels:
                return False
            channel = p.channels[channel_name]
            if channel.trace is not None:
                channel.trace.emptied(channel, "channel deleted")
            self._disconnect_clients(channel)
            folder = await p.remove_channel(channel_name)
            # The partition's new floor first (unused while the channel is stored), so a
            # delete finished by start() leaves the floor a normal delete would.
            self._store_topic(topic)
            await self.meta.flush()
            grave = await asyncio.to_thread(bury, folder)
            self.meta.delete(channel_key(topic_name, p.number, channel_name))
            await self.meta.flush()
            # Within the lock: a channel made again may have no store folder, and start()
            # must not take it for the one this tombstone was.
            if grave is not None:
                await asyncio.to_thread(remove_grave, grave)
        self.lookup.channel_deleted(topic_name, channel_name)
        log.info("channel_deleted", topic=topic_name, partition=p.number, channel=channel_name)
        if topic.ephemeral and not any(True for _ in topic.channels()):
            await self.delete_topic(topic_name)
        return True

    async def _finish_deletes(self) -> None:
        """At start, before any topic opens: a tombstone whose topic or channel is still in
        the metadata while nothing is under its name is a delete a crash interrupted:
        forget the metadata (flushed); then remove every tombstone."""
        graves = await asyncio.to_thread(find_tombstones, self.options.data_path)
        if not graves:
            return
        for grave, topic, partition, channel in graves:
            if os.path.exists(buried_path(grave)):
                continue  # made again after the delete: the tombstone is all that is left
            if channel is not None:
                self.meta.delete(channel_key(topic, partition, channel))
            else:
                self._forget_topic(topic)
                self.meta.delete_prefix(f"channel/{topic}/")
            log.warning("delete_finished", topic=topic, partition=partition, channel=channel)
        await self.meta.flush()
        for grave, *_ in graves:
            await asyncio.to_thread(remove_grave, grave)

    def client_left(self, channel: Channel) -> None:
        """An ephemeral channel goes when its last client does."""
        if channel.ephemeral and not channel.clients:
            asyncio.get_running_loop().create_task(
                self.delete_channel(channel.topic_name, channel.name, channel.partition))

    def _disconnect_clients(self, channel: Channel) -> None:
        for conn in list(self.connections):
            if conn.client.channels.get(channel.partition) is channel:
                conn.close()

    async def apply_topic_settings(self, topic: Topic, sync: tuple[int, int],
                                   retention_ms: int | None, paused: bool) -> None:
        """A cluster topic's own sync policy, retention and pause, as its metadata says;
        stored when they change (a restart opens it with them before etcd answers)."""
        if (topic.sync, topic.retention_ms, topic.paused) == (sync, retention_ms, paused):
            return
        topic.set_sync(sync)
        topic.retention_ms = retention_ms
        if paused and not topic.paused:
            topic.pause()
        elif topic.paused and not paused:
            topic.unpause()
        self._store_topic(topic)
        await self.meta.flush()
        log.info("topic_settings_applied", topic=topic.name, sync_every=sync[0],
                 sync_timeout_ms=sync[1], retention_ms=retention_ms, paused=paused)

    def _store_topic(self, topic: Topic) -> None:
        if not topic.ephemeral:
            self._put_topic(topic.name, topic.state())

    def _put_topic(self, name: str, state: dict) -> None:
        """Every put of a topic's state goes through here: `_topic_states` is what the
        metadata holds (or will, once flushed) under each topic key."""
        self._topic_states[name] = state
        self.meta.put(topic_key(name), state)

    def _forget_topic(self, name: str) -> None:
        self._topic_states.pop(name, None)
        self.meta.delete(topic_key(name))

    def _store_channel(self, channel: Channel) -> None:
        if not channel.ephemeral and not channel.topic.ephemeral:
            state = channel.checkpoint()
            self.meta.put(channel_key(channel.topic_name, channel.partition, channel.name),
                          state)
            part = channel.topic.partitions.get(channel.partition)
            if part is not None:  # a replicated partition's followers get it too
                part.writer.save_channel(channel, state)

    async def checkpoint(self) -> None:
        """Persist every changed cursor and topic state in one transaction (none changed:
        nothing is written). Only the channels in `_changed` are visited: one no longer
        held by its topic's partition (deleted, released, reopened) is left out."""
        for topic in self.topics.values():
            if not topic.ephemeral:
                state, stored = topic.state(), self._topic_states.get(topic.name)
                if state is not stored and state != stored:
                    self._put_topic(topic.name, state)
        changed = list(self._changed)
        self._changed.clear()
        for channel in changed:
            topic = channel.topic
            part = topic.partitions.get(channel.partition)
            if (channel.dirty and self.topics.get(topic.name) is topic and part is not None
                    and part.channels.get(channel.name) is channel):
                self._store_channel(channel)
        await self.meta.flush()

    # ---- background loops ------------------------------------------------

    async def _scan_loop(self) -> None:
        """Every SCAN_INTERVAL, the timeouts of the channels something may come due in."""
        while True:
            await asyncio.sleep(SCAN_INTERVAL)
            self.timeouts.scan(time.monotonic())

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.checkpoint_interval_ms / 1000)
            try:
                await self.checkpoint()
            except Exception as e:  # retried next time; the cursors only lag (and /ping says so)
                self.checkpoint_failures.failed(e)
            else:
                self.checkpoint_failures.ok()

    async def _retention_loop(self) -> None:
        """Drop old segments of every partition held here, led or followed (retain's rules:
        what every channel finished once `retention_min_age` old, or the topic's own
        retention; beyond --retention-max-age / --retention-max-bytes; never uncommitted)."""
        o = self.options
        while True:
            await asyncio.sleep(o.retention_check_interval_ms / 1000)
            held = [(t, p.number, p.queue, p.retention_floor())
                    for t in list(self.topics.values()) for p in list(t.partitions.values())
                    if not single_segment(p.queue)]
            if self.cluster is not None:
                held += [(self.topics.get(name), n, q, floor) for name, n, q, floor
                         in self.cluster.replication.followed_floors()
                         if not single_segment(q)]
            for topic, n, queue, floor in held:
                if topic is None or queue.failed is not None:  # a failed log waits for its reopen
                    continue
                min_age = topic.retention_ms if topic.retention_ms is not None \
                    else o.retention_min_age_ms
                before = queue.start_offset
                try:
                    start = await queue.retain(
                        before_offset=floor, min_age_s=min_age / 1000,
                        max_age_s=o.retention_max_age_ms / 1000 if o.retention_max_age_ms
                        else None,
                        max_bytes=o.retention_max_bytes or None)
                except Exception:
                    log.exception("retention_failed", topic=topic.name, partition=n)
                    continue
                if start != before and topic.trace is not None:
                    self.tracer.range_dropped(topic.name, n, "", start,
                                              f"retention: offsets {before} to {start}")
