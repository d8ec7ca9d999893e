"""A deterministic world around the real replication core (isr/core.py).

One process, no real time, no asyncio, no sockets: `World(seed).run(steps)` lets a
`random.Random(seed)` pick every step (deliver, drop, duplicate or hold a message, publish,
write or sync a disk, let a tick pass, crash or restart a node, cut or heal a link, stall
etcd), and checks the invariants (tests/sim/invariants.py) after each one. A failing seed
replays exactly: `python -m tests.sim --seed N --trace`.

The core is always reached through its module (`core.LeaderCore`, `core.push_verdict`,
`core.same_entries`, `core.truncation_point`, `core.EpochCache`), so that
tests/sim/mutations.py can put a bug back into it one at a time.
"""

from __future__ import annotations

import random
from collections import namedtuple

from isr import core, followcore
from isr.state import PartitionState

from .invariants import Checker, Violation

NODES = ("a:1", "b:1", "c:1")
ETCD = "etcd"

# timing, in ticks
TTL = 10  # a node's lease
REPL_TIMEOUT = 5  # a push unanswered this long: the follower failed
PUB_DEADLINE = 15  # a publish is answered by then
ETCD_TIMEOUT = 3  # an etcd call unanswered this long: outcome unknown
REQ_TIMEOUT = 4  # a follower's EPOCH_END / FETCH / JOIN unanswered this long: give up
JOIN_TIMEOUT = 12  # the leader abandons a JOIN not in the ISR by then

Entry = namedtuple("Entry", "epoch offset count_before timestamp size msg_count ids")


def start_of(e: Entry):
    return (e.offset, e.count_before)


def end_of(e: Entry):
    return (e.offset + e.size, e.count_before + e.msg_count)


def log_end(log):
    return end_of(log[-1]) if log else (0, 0)


def epoch_cache(log):
    cache = core.EpochCache()
    for e in log:
        cache.add(e.epoch, start_of(e))
    return cache


CLOG_SYNC_EVERY = 4  # entries: the real commitlog syncs every 4,096 (a lag of a few here)


class Disk:
    """A node's log: the synced entries, then the written ones a crash loses. As in
    diskqueue, a record's epoch lives in the commitlog, an index synced lazily
    (`index_synced`); a crash keeps the synced records past it, and recovery gives them
    the last surviving entry's epoch (0 when none survives). `index_rule` is
    GroupCommit._write_sync's: sync the index when CLOG_SYNC_EVERY entries are unsynced,
    or when a batch's epoch is above the highest the index synced since open."""

    def __init__(self):
        self.durable: list[Entry] = []
        self.volatile: list[Entry] = []
        self.version = 0
        self.index_synced = 0  # durable entries whose epochs a crash keeps
        self.index_epoch = 0  # the highest epoch the index synced since open (_clog_epoch)

    @property
    def log(self):
        return self.durable + self.volatile

    def end(self):
        return log_end(self.volatile or self.durable)

    def durable_end(self):
        return log_end(self.durable)

    def write(self, entries):
        assert not entries or start_of(entries[0]) == self.end(), (entries, self.end())
        self.volatile.extend(entries)
        self.version += 1

    def sync(self):
        """Sync the written batches, each with the index as `index_rule` says (a batch is
        acknowledged only after both: one job of the write worker)."""
        for e in self.volatile:
            self.durable.append(e)
            if self.index_rule(len(self.durable) - self.index_synced, e.epoch):
                self.index_synced = len(self.durable)
                self.index_epoch = max(self.index_epoch, e.epoch)
        if self.volatile:
            self.volatile = []
            self.version += 1

    def index_rule(self, unsynced: int, epoch: int) -> bool:
        return unsynced >= CLOG_SYNC_EVERY or epoch > self.index_epoch

    def truncate(self, cut):
        """Cut to the last entry boundary at or before `cut` (durable at once, index too)."""
        log = [e for e in self.log if end_of(e) <= tuple(cut)]
        self.durable, self.volatile = log, []
        self.index_synced, self.index_epoch = len(log), 0
        self.version += 1

    def crash(self):
        """Lose the unsynced writes; recovery rebuilds the index past its synced part."""
        lagging = self.durable[self.index_synced:]
        if lagging:
            epoch = self.durable[self.index_synced - 1].epoch if self.index_synced else 0
            self.durable[self.index_synced:] = [e._replace(epoch=epoch) for e in lagging]
        if self.volatile or lagging:
            self.volatile = []
            self.version += 1
        self.index_synced, self.index_epoch = len(self.durable), 0


class Msg:
    __slots__ = ("src", "dst", "kind", "body", "ready", "seq")

    def __init__(self, src, dst, kind, body, ready, seq):
        self.src, self.dst, self.kind, self.body, self.ready, self.seq = (
            src, dst, kind, body, ready, seq)

    def __repr__(self):
        return f"{self.kind}({self.src}->{self.dst} {self.body})"


class Waiter:
    __slots__ = ("pub", "entry", "deadline")

    def __init__(self, pub, entry, deadline):
        self.pub, self.entry, self.deadline = pub, entry, deadline


class LeaderDriver:
    """What isr/leader.py does around a LeaderCore, with the simulated disk and network."""

    def __init__(self, world, node, state, inc):
        self.w = world
        self.node = node
        self.inc = inc  # this leadership's id (answers to an older one are dropped)
        # A real replica's write and its sync are one job of its write worker, and its log
        # ends where that job left it when it starts leading (q.written_end): no written,
        # unsynced tail that the core would not count but its epochs and pushes would.
        node.disk.sync()
        log = node.disk.log
        self.pushed_log = list(log)  # written, being written, or pushed
        self.pending = []  # pushed, not yet handed to the disk
        self.core = core.LeaderCore(node.id, state, min_isr=world.min_isr,
                                    written=node.disk.durable_end(), epochs=epoch_cache(log),
                                    repl_timeout=REPL_TIMEOUT)
        self.epoch = 0
        self.writable = False
        self.solo = False
        self.committed = (0, 0)
        self.waiters: list[Waiter] = []
        self.joins = {}  # node -> {"copy_end", "deadline"}
        self.etcd_req = None  # (request id, deadline) of the etcd call in flight
        self.stopped = False

    # ---- actions ----

    def run(self):
        while True:
            actions = self.core.take()
            if not actions:
                return
            for a in actions:
                self.do(a)

    def do(self, a):
        w = self.w
        w.trace(f"  {self.node.id}#{self.inc} {a.kind} {a.args}")
        if a.kind == "cas":
            expected, new = a.args
            self.etcd_call("cas", {"expected": expected, "new": new})
        elif a.kind == "read":
            self.etcd_call("read", {})
        elif a.kind == "epoch":
            self.epoch = a.args[0]
            self.node.fence = max(self.node.fence, self.epoch)
        elif a.kind == "writable":
            self.writable = a.args[0]
            if not self.writable:
                self.fail_waiters(f"not writable: {a.args[1]}")
        elif a.kind == "solo":
            self.solo = a.args[0]
            if self.solo:
                self.commit(self.core.written)
        elif a.kind == "commit":
            self.commit(a.args[0])
        elif a.kind == "joined":
            node, epoch = a.args
            w.checker.joined(w, self, w.nodes[node])
            w.stats["joined"] += 1
            j = self.joins.pop(node, None) or {}
            w.send(self.node.id, node, "JOINED", {"leader": self.node.id, "inc": self.inc,
                                                  "rid": j.get("rid")})
        elif a.kind == "join_failed":
            node, reason = a.args
            j = self.joins.pop(node, None) or {}
            w.send(self.node.id, node, "JOIN_FAILED", {"leader": self.node.id, "inc": self.inc,
                                                       "rid": j.get("rid")})
        elif a.kind == "stop":
            self.stopped = True
            self.node.key_released = True
            self.fail_waiters(f"stopped: {a.args[0]}")

    def etcd_call(self, kind, body):
        w = self.w
        w.req_ids += 1
        rid = w.req_ids
        self.etcd_req = (rid, w.now + ETCD_TIMEOUT)
        body = dict(body, rid=rid, inc=self.inc)
        w.send(self.node.id, ETCD, kind, body)

    def etcd_answer(self, msg):
        if self.etcd_req is None or msg.body["rid"] != self.etcd_req[0]:
            return  # a late answer to a call already taken as unknown
        self.etcd_req = None
        kind = msg.body["outcome"]
        if kind == "applied":
            self.core.cas_applied(msg.body["state"])
        elif kind == "conflict":
            self.core.cas_conflict(msg.body["state"])
        elif kind == "read":
            self.core.state_read(msg.body["state"])
        else:
            self.core.cas_unknown()
        self.run()

    def commit(self, pos):
        pos = tuple(pos)
        if pos <= self.committed:
            return
        self.committed = pos
        w = self.w
        w.stats["commits"] += 1
        w.checker.committed(w, self, pos)
        still = []
        for wt in self.waiters:
            if end_of(wt.entry) <= pos:
                w.checker.acked(w, self, wt)
            else:
                still.append(wt)
        self.waiters = still
        self.check_joins()

    def fail_waiters(self, why):
        for wt in self.waiters:
            self.w.checker.answered(wt, why)
        self.waiters = []

    def check_joins(self):
        for node in list(self.joins):
            if node in self.core.counted and self.core.join_level(node):
                self.core.join_ready(node)
        self.run()

    # ---- publishing ----

    def publish(self, pub, ids, size_each):
        w = self.w
        start = log_end(self.pushed_log)
        e = Entry(self.epoch, start[0], start[1], w.now, size_each * len(ids), len(ids),
                  tuple(ids))
        followers = self.core.pushed_batch(start, end_of(e), self.epoch)
        if followers is None:
            self.run()
            w.checker.answered(Waiter(pub, e, 0), "not pushed")
            return
        self.pushed_log.append(e)
        self.pending.append(e)
        self.waiters.append(Waiter(pub, e, w.now + PUB_DEADLINE))
        for f in followers:
            self.push(f, [e], start)
        self.run()

    def push(self, f, entries, start):
        self.w.send(self.node.id, f, "PUSH", {
            "leader": self.node.id, "inc": self.inc, "epoch": self.epoch, "start": start,
            "entries": entries, "commit": self.committed})
        if entries:
            self.core.sent(f, self.w.now)

    def disk_write(self):
        """The next pushed batch reaches the local disk (not synced yet)."""
        if self.pending:
            self.node.disk.write([self.pending.pop(0)])
            return True
        return False

    def synced(self):
        low = self.core.written_to(self.node.disk.durable_end())
        if low is not None:
            self.commit(low)
        if self.solo and not self.stopped:
            self.commit(self.core.written)
        self.run()

    # ---- from followers ----

    def receive(self, msg):
        b = msg.body
        c = self.core
        src = msg.src
        if msg.kind == "ACK":
            low = c.acked(src, b["end"])
            if low is not None:
                self.commit(low)
            j = self.joins.get(src)
            if j is not None and tuple(b["end"]) >= j["copy_end"] and src not in c.counted:
                c.join_count(src, b["end"])
            self.check_joins()
        elif msg.kind == "REFUSED":
            c.refused(src, b.get("seen"), b.get("why", ""))
            self.run()
        elif msg.kind == "EPOCH_END":
            if not self.epoch or self.stopped or b["epoch"] > self.epoch:
                self.w.send(self.node.id, src, "ERROR", {"rid": b["rid"]})
                return
            epoch, end = c.epoch_end(b["last"])
            self.w.send(self.node.id, src, "EPOCH", {
                "rid": b["rid"], "epoch": epoch, "end": tuple(end), "leader_epoch": self.epoch,
                "inc": self.inc})
        elif msg.kind == "FETCH":
            if not self.epoch or self.stopped or b["leader_epoch"] != self.epoch:
                self.w.send(self.node.id, src, "ERROR", {"rid": b["rid"], "epoch": self.epoch})
                return
            written = [e for e in self.pushed_log if end_of(e) <= c.written]
            at = tuple(b["end"])
            i = next((k for k, e in enumerate(written) if start_of(e) == at), None)
            if i is None and at != log_end(written):
                self.w.send(self.node.id, src, "ERROR", {"rid": b["rid"]})
                return
            chunk = written[i:i + 3] if i is not None else []
            self.w.send(self.node.id, src, "DATA", {
                "rid": b["rid"], "at": at, "entries": chunk, "commit": self.committed,
                "end": log_end(written)})
        elif msg.kind == "JOIN":
            answer = {"leader": self.node.id, "inc": self.inc, "rid": b["rid"]}
            if not self.epoch or self.stopped or b["leader_epoch"] != self.epoch:
                self.w.send(self.node.id, src, "JOIN_FAILED", dict(answer, epoch=self.epoch))
                return
            at = tuple(b["end"])
            i = next((k for k, e in enumerate(self.pushed_log) if start_of(e) == at), None)
            if i is None and at != log_end(self.pushed_log):
                self.w.send(self.node.id, src, "JOIN_FAILED", answer)
                return
            begun = c.join_begin(src)
            if begun is None:  # its last JOIN is still going: ask again later
                self.w.send(self.node.id, src, "JOIN_FAILED", answer)
                return
            if not begun:
                self.w.send(self.node.id, src, "JOINED", answer)
                return
            copy = self.pushed_log[i:] if i is not None else []
            self.joins[src] = {"copy_end": log_end(self.pushed_log), "rid": b["rid"],
                               "deadline": self.w.now + JOIN_TIMEOUT}
            self.push(src, copy, at)
            if not copy:
                c.join_count(src, at)
            self.check_joins()

    def tick(self):
        w = self.w
        c = self.core
        if self.etcd_req is not None and w.now > self.etcd_req[1]:
            self.etcd_req = None
            c.cas_unknown()
        c.tick(w.now)
        for node, j in list(self.joins.items()):
            if w.now > j["deadline"]:
                c.join_abandon(node)
                if node in c.joining:
                    continue
                self.joins.pop(node, None)
        self.run()
        still = []
        for wt in self.waiters:
            if w.now >= wt.deadline:
                w.checker.answered(wt, "timeout")
            else:
                still.append(wt)
        self.waiters = still
        if self.epoch and not self.stopped:  # commit updates
            for f in c.followers:
                if f in c.state.isr or f in c.joining:
                    self.push(f, [], log_end(self.pushed_log))


class Node:
    """One replica: its disk, its leadership (a LeaderDriver) or its follower side, which is
    the real `FollowerCore` (isr/followcore.py) driven as isr/follower.py drives it, with
    the simulated disk and network."""

    def __init__(self, world, nid):
        self.w = world
        self.id = nid
        self.alive = True
        self.disk = Disk()
        self.fence = 0  # persisted (fence.json)
        self.skew = 0
        self.reset()

    def reset(self):
        self.fc: followcore.FollowerCore | None = None  # the follower side, while following
        self.commit = (0, 0)  # the committed end this replica knows
        self.driver: LeaderDriver | None = None
        self.view: PartitionState | None = None
        self.writing = False  # a push group written, answered once synced
        self.requests = {}  # rid -> deadline of the follower's requests to a leader
        self.chunk = None  # (rid, entries) of the last FETCH answer
        self.retry_at = None
        self.key_released = False
        self.refreshed = self.w.now  # last lease refresh, on this node's clock

    def fencing(self):
        log = self.disk.log
        return max(self.fence, log[-1].epoch if log else 0)

    # ---- the etcd view ----

    def see(self, state):
        if self.view is not None and state.revision <= self.view.revision:
            return
        self.view = state
        d = self.driver
        if d is not None:
            d.core.seen(state)
            d.run()
            if not d.stopped:
                return
            self.driver = None
            if state.leader == self.id and not self.key_released:
                return
        if state.leader == self.id and not self.key_released:
            self.lead(state)
            return
        outside = state.leader is not None and self.id not in state.isr
        self.follower().follow(state.leader, state.epoch, outside)
        self.run()

    def lead(self, state):
        w = self.w
        w.leaderships += 1
        if self.fc is not None:  # the follower side closes before the partition is led
            self.fc.close()
            self.run()
            self.fc, self.writing, self.requests, self.chunk, self.retry_at = (
                None, False, {}, None, None)
        self.driver = LeaderDriver(w, self, state, w.leaderships)
        w.trace(f"  {self.id} leads #{w.leaderships} at {state}")
        self.driver.core.begin()
        self.driver.run()

    # ---- the follower side ----

    def follower(self):
        if self.fc is None:
            log = self.disk.log
            self.fc = followcore.FollowerCore(fence=self.fencing(), end=self.disk.end(),
                                              last_epoch=epoch_cache(log).last, join_lag=0)
        return self.fc

    def on_push(self, msg):
        b = msg.body
        if self.driver is not None and not self.driver.stopped:
            if b["epoch"] < self.fencing():
                self.reply(msg, "REFUSED", {"seen": self.fencing()})
            else:
                self.reply(msg, "REFUSED", {"seen": None, "why": "leading"})
            return
        entries = b["entries"]
        start = tuple(b["start"])
        self.follower().push(followcore.Push(
            b["leader"], b["epoch"], start, end_of(entries[-1]) if entries else start,
            len(entries), tuple(b["commit"]), msg))
        self.run()

    def reply(self, msg, kind, body):
        self.w.send(self.id, msg.src, kind, dict(body, inc=msg.body["inc"]))

    def run(self):
        """Do what the follower core asks, in order (isr/follower.py's `_run`)."""
        fc = self.fc
        while fc is not None and (steps := fc.take()):
            for step in steps:
                self.w.trace(f"  {self.id} follower {step.kind} {step.args}")
                getattr(self, "_" + step.kind)(*step.args)

    def _answer(self, pushes, result):
        for p in pushes:
            if result[0] == "ack":
                self.reply(p.token, "ACK", {"end": result[1]})
            elif result[0] == "stale":
                self.reply(p.token, "REFUSED", {"seen": result[1], "why": "stale"})
            else:
                self.reply(p.token, "REFUSED", {"seen": None, "why": str(result[1])})

    def _commit(self, pos):
        self.commit = max(self.commit, min(tuple(pos), self.disk.end()))

    def _append(self, group):
        """DiskQueue.append_raw's job: a batch wholly within the log is a duplicate only when
        its entries are the ones held; else it must start at the end, epochs never back."""
        entries = [e for p in group for e in p.token.body["entries"]]
        start, log, end = group[0].start, self.disk.log, self.disk.end()
        if end_of(entries[-1]) <= end:
            i = next((k for k, e in enumerate(log) if start_of(e) == start), None)
            held = log[i:i + len(entries)] if i is not None else []
            if core.same_entries(entries, held):
                return self.fc.written(end, epoch_cache(log).last)
            self.w.trace(f"  {self.id} diverges from push at {start}")
            return self.fc.written(end, epoch_cache(log).last, "diverged", True)
        if start != end:
            return self.fc.written(end, epoch_cache(log).last, "gap")
        if log and entries[0].epoch < log[-1].epoch:
            return self.fc.written(end, epoch_cache(log).last, "bad batch: epoch back")
        self.disk.write(entries)
        self.writing = True  # answered once synced (the real job writes and syncs)

    def _fence(self, epoch):
        self.fence = max(self.fence, epoch)
        self.fc.fenced(epoch)

    def ask(self, rid, leader, kind, body, timeout=REQ_TIMEOUT):
        self.requests[rid] = self.w.now + timeout
        self.w.send(self.id, leader, kind, dict(body, rid=rid))

    def _epoch_end(self, rid, leader, epoch, last_epoch):
        self.ask(rid, leader, "EPOCH_END", {"epoch": epoch, "last": last_epoch})

    def _truncate(self, cut):
        log = self.disk.log
        if tuple(cut) < self.commit:  # DiskQueue.truncate_to never cuts what is committed
            return self.fc.truncated(self.disk.end(), epoch_cache(log).last,
                                     f"cut {cut} below the commit {self.commit}")
        self.w.trace(f"  {self.id} truncates to {cut}")
        self.disk.truncate(cut)
        self.w.stats["truncated"] += 1
        self.fc.truncated(self.disk.end(), epoch_cache(self.disk.log).last)

    def _fetch(self, rid, leader, epoch, pos):
        self.ask(rid, leader, "FETCH", {"end": pos, "leader_epoch": epoch})

    def _append_fetched(self, rid):
        _rid, entries = self.chunk
        self.chunk = None
        if entries and start_of(entries[0]) != self.disk.end():
            return self.fc.written(self.disk.end(), epoch_cache(self.disk.log).last, "gap")
        self.disk.write(entries)
        self.disk.sync()  # a fetched chunk is synced before the next request
        self.fc.written(self.disk.end(), epoch_cache(self.disk.log).last)

    def _restart(self, start):
        raise AssertionError("the simulated leader never answers out of range")

    def _join(self, rid, leader, epoch, pos):
        self.ask(rid, leader, "JOIN", {"end": pos, "leader_epoch": epoch})

    def _retry(self, delay):
        self.retry_at = self.w.now + 1

    def _level(self, leader, epoch):
        self.w.stats["reconciled"] += 1  # (on_answer checks the log against that leader's)

    def on_answer(self, msg):
        """EPOCH / DATA / ERROR / JOINED / JOIN_FAILED answers to the follower's requests."""
        b = msg.body
        rid = b.get("rid")
        fc = self.fc
        if fc is None or self.requests.pop(rid, None) is None:
            return  # answered already, timed out, or asked by a follower side since closed
        if msg.kind in ("ERROR", "JOIN_FAILED"):
            fc.request_failed(rid, "refused", b.get("epoch"))
        elif msg.kind == "EPOCH":
            log = self.disk.log
            e = b["epoch"]
            own = next((start_of(x) for x in log if x.epoch > e), log_end(log))
            level_before = fc.level
            fc.epoch_answer(rid, e, b["end"], own)
            if fc.level != level_before and fc.level is not None:
                d = self.w.nodes[msg.src].driver
                if d is not None and d.inc == b["inc"]:
                    self.w.checker.level(self.w, d, self)
        elif msg.kind == "DATA":
            entries = b["entries"]
            self.chunk = (rid, entries)
            fc.fetched(rid, tuple(b["at"]), len(entries), tuple(b["end"]), tuple(b["commit"]))
        elif msg.kind == "JOINED":
            fc.joined(rid)
        self.run()

    def synced(self):
        if self.writing and self.fc is not None:
            self.writing = False
            self.fc.written(self.disk.end(), epoch_cache(self.disk.log).last)
            self.run()
        if self.driver is not None:
            self.driver.synced()

    def catch_up(self):
        """A catch-up waiting for its retry goes now (as if its pause had passed)."""
        if self.fc is None or self.retry_at is None:
            return False
        self.retry_at = None
        self.fc.retry()
        self.run()
        return True

    def tick(self):
        w = self.w
        fc = self.fc
        if fc is not None:
            for rid, deadline in list(self.requests.items()):
                if w.now > deadline:
                    del self.requests[rid]
                    fc.request_failed(rid, "timeout")
            if self.retry_at is not None and w.now >= self.retry_at:
                self.retry_at = None
                fc.retry()
            self.run()
        d = self.driver
        if d is not None:
            if not d.stopped and w.now - self.refreshed > TTL - 1:
                d.core.stop("lease lost")
                d.run()
            d.tick()
            if d.stopped:
                self.driver = None


class World:
    def __init__(self, seed, *, min_isr=2, trace=False):
        self.seed = seed
        self.rng = random.Random(seed)
        self.min_isr = min_isr
        self.tracing = trace
        self.log_lines = []
        self.now = 0
        self.seq = 0
        self.req_ids = 0
        self.pubs = 0
        self.msg_ids = 0
        self.leaderships = 0
        self.msgs: list[Msg] = []
        self.cut = set()  # frozenset({x, y}) links that drop what they carry
        self.etcd_stalled = False
        self.unknown_rate = 0.0
        self.master_skew = 0
        self.intensity = self.rng.choice((0.1, 0.3, 0.6, 1.0))
        self.nodes = {n: Node(self, n) for n in NODES}
        for n in self.nodes.values():
            n.skew = self.rng.randint(-2, 2)
        self.state = PartitionState(leader=NODES[0], isr=NODES, epoch=1, revision=1)
        self.revision = 1
        self.lease = {n: TTL for n in NODES}  # etcd time a node's lease runs out
        self.checker = Checker()
        self.stats = dict.fromkeys(("reconciled", "truncated", "joined", "unknown", "elected",
                                    "commits"), 0)
        for n in self.nodes.values():
            n.see(self.state)

    def trace(self, line):
        if self.tracing:
            self.log_lines.append(f"{self.now:4} {line}")

    def send(self, src, dst, kind, body, delay=0):
        self.seq += 1
        self.msgs.append(Msg(src, dst, kind, body, self.now + delay, self.seq))

    # ---- etcd ----

    def put(self, new):
        self.revision += 1
        self.state = new.evolve(revision=self.revision)
        self.trace(f"etcd {self.state}")
        for n in NODES:
            self.send(ETCD, n, "WATCH", {"state": self.state})
        return self.state

    def etcd_receive(self, msg):
        b = msg.body
        rng = self.rng
        unknown = rng.random() < self.unknown_rate
        out = {"rid": b["rid"], "inc": b["inc"]}
        if msg.kind == "cas":
            if b["expected"].revision != self.state.revision:
                out.update(outcome="conflict", state=self.state)
            else:
                written = self.put(b["new"])
                out.update(outcome="applied", state=written)
            if unknown:
                out = {"rid": b["rid"], "inc": b["inc"], "outcome": "unknown"}
        else:
            out.update(outcome="read", state=self.state)
            if unknown:
                out["outcome"] = "unknown"
        if unknown:
            self.stats["unknown"] += 1
        if unknown and rng.random() < 0.5:  # the call applied, its answer lost
            return self.send(ETCD, msg.src, "ETCD", dict(out, outcome="unknown"),
                             delay=ETCD_TIMEOUT + 1)
        self.send(ETCD, msg.src, "ETCD", out)

    def master(self):
        """Elect a live ISR member, epoch + 1, when the leader's lease ran out."""
        s = self.state
        clock = self.now + self.master_skew
        lead = s.leader
        if lead is not None and self.lease[lead] >= clock and not self.nodes[lead].key_released:
            return
        live = [n for n in s.isr if self.lease[n] >= clock and self.nodes[n].alive]
        if not live:
            return
        new = self.rng.choice(live)
        self.nodes[new].key_released = False
        self.trace(f"master elects {new}")
        self.stats["elected"] += 1
        self.put(s.evolve(leader=new, epoch=s.epoch + 1))

    # ---- steps ----

    def deliver_some(self):
        ready = self.deliverable()
        if ready:
            self.deliver(min(ready, key=lambda m: m.seq))

    def deliverable(self):
        return [m for m in self.msgs if m.ready <= self.now and not (
            self.etcd_stalled and ETCD in (m.src, m.dst))]

    def deliver(self, m):
        self.msgs.remove(m)
        if frozenset((m.src, m.dst)) in self.cut:
            self.trace(f"cut {m}")
            return
        self.trace(f"deliver {m}")
        if m.dst == ETCD:
            node = self.nodes[m.src]
            d = node.driver
            if node.alive and d is not None and d.inc == m.body["inc"]:
                self.etcd_receive(m)
            return
        node = self.nodes[m.dst]
        if not node.alive:
            return
        k = m.kind
        if k == "WATCH":
            node.see(m.body["state"])
        elif k == "ETCD":
            if node.driver is not None and node.driver.inc == m.body["inc"]:
                node.driver.etcd_answer(m)
        elif k == "PUSH":
            node.on_push(m)
        elif k in ("ACK", "REFUSED", "EPOCH_END", "FETCH", "JOIN"):
            d = node.driver
            if d is not None and not d.stopped and (k not in ("ACK", "REFUSED")
                                                    or m.body["inc"] == d.inc):
                d.receive(m)
            elif k == "EPOCH_END" or k == "FETCH":
                self.send(node.id, m.src, "ERROR", {"rid": m.body["rid"]})
        elif k in ("EPOCH", "DATA", "ERROR", "JOINED", "JOIN_FAILED"):
            node.on_answer(m)

    def tick(self):
        self.now += 1
        if self.etcd_stalled and self.now >= self.stall_until:
            self.etcd_stalled = False
            self.trace("etcd answers again")
        for n in self.nodes.values():
            if n.alive and not self.etcd_stalled and frozenset((n.id, ETCD)) not in self.cut:
                self.lease[n.id] = self.now + TTL
                n.refreshed = self.now
        for n in self.nodes.values():
            if n.alive:
                n.tick()
        self.master()

    def crash(self, n):
        self.trace(f"CRASH {n.id}")
        if n.driver is not None:
            n.driver.fail_waiters("connection lost")
        n.alive = False
        n.down_until = self.now + self.rng.choice((1, TTL // 2, TTL - 2, 2 * TTL))
        n.disk.crash()
        n.reset()
        self.msgs = [m for m in self.msgs if m.src != n.id or m.dst == ETCD]

    def restart(self, n):
        self.trace(f"RESTART {n.id}")
        n.alive = True
        n.reset()
        n.see(self.state)  # its first read of the partition state

    def publish(self):
        lead = self.state.leader
        node = self.nodes.get(lead) if lead else None
        if node is None or not node.alive or node.driver is None or not node.driver.writable:
            return
        self.pubs += 1
        ids = []
        for _ in range(self.rng.randint(1, 3)):
            self.msg_ids += 1
            ids.append(self.msg_ids)
        self.trace(f"PUB {self.pubs} {ids} to {lead}")
        node.driver.publish(self.pubs, ids, self.rng.choice((10, 20)))

    def step(self):
        rng = self.rng
        r = rng.random()
        alive = [n for n in self.nodes.values() if n.alive]
        if not alive:
            self.restart(rng.choice(list(self.nodes.values())))
            return
        if r >= 0.93 and rng.random() > self.intensity:
            r = 0.0  # a calm seed: fewer faults
        if r < 0.50:
            ready = self.deliverable()
            if ready:
                m = rng.choice(ready)
                if rng.random() < 0.95:  # the oldest of a random link, else any (reorder)
                    m = min((x for x in ready if (x.src, x.dst) == (m.src, m.dst)),
                            key=lambda x: x.seq)
                self.deliver(m)
                return
            self.tick()
        elif r < 0.60:
            self.publish()
        elif r < 0.68:
            writers = [n for n in alive if n.driver is not None and n.driver.pending]
            if writers:
                n = rng.choice(writers)
                n.driver.disk_write()
                self.trace(f"write {n.id}")
        elif r < 0.78:
            n = rng.choice(alive)
            self.trace(f"sync {n.id}")
            n.disk.sync()
            n.synced()
        elif r < 0.86:
            self.tick()
        elif r < 0.90:
            self.deliver_some()
        elif r < 0.93:
            n = rng.choice(alive)
            if n.catch_up():
                self.trace(f"catch-up {n.id}")
        elif r < 0.94:
            if self.msgs:
                m = rng.choice(self.msgs)
                if ETCD not in (m.src, m.dst):
                    self.trace(f"drop {m}")
                    self.msgs.remove(m)
        elif r < 0.95:
            if self.msgs:
                m = rng.choice(self.msgs)
                if ETCD not in (m.src, m.dst):
                    self.trace(f"duplicate {m}")
                    self.send(m.src, m.dst, m.kind, m.body, delay=rng.randint(0, 2))
        elif r < 0.965:
            if len(alive) > 1 or rng.random() < 0.3:
                self.crash(rng.choice(alive))
        elif r < 0.98:
            dead = [n for n in self.nodes.values() if not n.alive and self.now >= n.down_until]
            if dead:
                self.restart(rng.choice(dead))
        elif r < 0.99:
            if self.cut and rng.random() < 0.6:
                link = rng.choice(sorted(self.cut, key=sorted))
                self.cut.discard(link)
                self.trace(f"heal {sorted(link)}")
            else:
                x = rng.choice(NODES + (ETCD,))
                y = rng.choice(NODES)
                if x != y and len(self.cut) < 2:
                    self.cut.add(frozenset((x, y)))
                    self.trace(f"cut {x}-{y}")
        elif r < 0.995:
            if not self.etcd_stalled:
                self.etcd_stalled = True
                self.stall_until = self.now + rng.randint(1, 2 * ETCD_TIMEOUT)
                self.trace(f"etcd stalls until {self.stall_until}")
        else:
            self.unknown_rate = rng.choice((0.0, 0.0, 0.2, 0.5))
            self.master_skew = rng.randint(-2, 2)
            self.trace(f"etcd unknown rate {self.unknown_rate}, master skew {self.master_skew}")

    def run(self, steps):
        """Run `steps` steps; raise Violation (with the trace so far) at the first one."""
        try:
            for i in range(steps):
                self.step()
                self.checker.check(self)
        except Violation as v:
            v.seed = self.seed
            v.step = i
            raise
        return self
