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

from isr import core
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
            self.joins.pop(node, None)
            w.send(self.node.id, node, "JOINED", {"leader": self.node.id, "inc": self.inc})
        elif a.kind == "join_failed":
            node, reason = a.args
            self.joins.pop(node, None)
            w.send(self.node.id, node, "JOIN_FAILED", {"leader": self.node.id, "inc": self.inc})
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
            if not self.epoch or self.stopped:
                self.w.send(self.node.id, src, "ERROR", {"rid": b["rid"]})
                return
            epoch, end = c.epoch_end(b["last"])
            self.w.send(self.node.id, src, "EPOCH", {
                "rid": b["rid"], "epoch": epoch, "end": tuple(end), "leader_epoch": self.epoch,
                "inc": self.inc})
        elif msg.kind == "FETCH":
            if not self.epoch or self.stopped or b["leader_epoch"] != self.epoch:
                self.w.send(self.node.id, src, "ERROR", {"rid": b["rid"]})
                return
            written = [e for e in self.pushed_log if end_of(e) <= c.written]
            at = tuple(b["end"])
            i = next((k for k, e in enumerate(written) if start_of(e) == at), None)
            if i is None and at != log_end(written):
                self.w.send(self.node.id, src, "ERROR", {"rid": b["rid"]})
                return
            chunk = written[i:i + 3] if i is not None else []
            self.w.send(self.node.id, src, "DATA", {
                "rid": b["rid"], "entries": chunk, "commit": self.committed,
                "more": i is not None and i + 3 < len(written)})
        elif msg.kind == "JOIN":
            if not self.epoch or self.stopped or b["leader_epoch"] != self.epoch:
                self.w.send(self.node.id, src, "JOIN_FAILED", {"leader": self.node.id,
                                                               "inc": self.inc})
                return
            at = tuple(b["end"])
            i = next((k for k, e in enumerate(self.pushed_log) if start_of(e) == at), None)
            if i is None and at != log_end(self.pushed_log):
                self.w.send(self.node.id, src, "JOIN_FAILED", {"leader": self.node.id,
                                                               "inc": self.inc})
                return
            begun = c.join_begin(src)
            if begun is None:  # its last JOIN is still going: ask again later
                self.w.send(self.node.id, src, "JOIN_FAILED", {"leader": self.node.id,
                                                               "inc": self.inc})
                return
            if not begun:
                self.w.send(self.node.id, src, "JOINED", {"leader": self.node.id,
                                                          "inc": self.inc})
                return
            copy = self.pushed_log[i:] if i is not None else []
            self.joins[src] = {"copy_end": log_end(self.pushed_log),
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
    def __init__(self, world, nid):
        self.w = world
        self.id = nid
        self.alive = True
        self.disk = Disk()
        self.fence = 0  # persisted (fence.json)
        self.skew = 0
        self.reset()

    def reset(self):
        self.level = None  # (leader, epoch) the log is checked level with
        self.commit = (0, 0)  # the committed end this replica knows
        self.driver: LeaderDriver | None = None
        self.view: PartitionState | None = None
        self.recon = None  # the follower's EPOCH_END rounds / catch-up in progress
        self.held = []  # pushes waiting for the reconcile
        self.acks = []  # (leader, inc) of pushes to ACK after the next sync
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

    def lead(self, state):
        w = self.w
        w.leaderships += 1
        self.recon, self.held, self.acks, self.level = None, [], [], None
        self.driver = LeaderDriver(w, self, state, w.leaderships)
        w.trace(f"  {self.id} leads #{w.leaderships} at {state}")
        self.driver.core.begin()
        self.driver.run()

    # ---- the follower side ----

    def on_push(self, msg):
        b = msg.body
        if self.driver is not None and not self.driver.stopped:
            if b["epoch"] < self.fencing():
                self.reply_refused(msg, self.fencing())
            else:
                self.reply_refused(msg, None, "leading")
            return
        self.push(msg)

    def reply_refused(self, msg, seen, why="stale"):
        self.w.send(self.id, msg.src, "REFUSED", {"inc": msg.body["inc"], "seen": seen,
                                                  "why": why})

    def push(self, msg):
        r = self.recon
        if r is not None and r["purpose"] == "catchup" and r["phase"] == "epoch":
            # isr/follower.py runs a catch-up's EPOCH_END rounds under its lock: pushes wait
            self.held.append(msg)
            return
        b = msg.body
        entries = b["entries"]
        while True:
            v = core.push_verdict(self.fencing(), self.level, self.disk.end(), b["leader"],
                                  b["epoch"], b["start"], len(entries))
            if v != core.Verdict.FENCE:
                break
            self.fence = b["epoch"]
            self.level = None
        V = core.Verdict
        if v == V.STALE:
            self.reply_refused(msg, self.fencing())
        elif v == V.RECONCILE:
            self.reconcile(msg)
        elif v == V.COMMIT:
            self.learn_commit(b["commit"])
        elif v == V.APPEND:
            self.disk.write(entries)
            self.accepted(msg)
        elif v == V.CHECK:
            log = self.disk.log
            i = next((k for k, e in enumerate(log) if start_of(e) == tuple(b["start"])), None)
            held = log[i:i + len(entries)] if i is not None else []
            if i is not None and core.same_entries(entries[:len(held)], held):
                self.disk.write(entries[len(held):])
                self.accepted(msg)
            else:
                self.w.trace(f"  {self.id} diverges from push at {b['start']}")
                self.level = None
                self.reconcile(msg)
        else:  # GAP
            self.reply_refused(msg, None, "gap")

    def accepted(self, msg):
        self.acks.append((msg.src, msg.body["inc"]))
        self.learn_commit(msg.body["commit"])

    def learn_commit(self, commit):
        c = min(tuple(commit), self.disk.end())
        if c > self.commit:
            self.commit = c

    def reconcile(self, msg, purpose="push"):
        """KIP-279 rounds with the pushing leader; its pushes wait (in order)."""
        b = msg.body
        r = self.recon
        if r is not None and r["leader"] == b["leader"] and r["inc"] == b["inc"] \
                and r["purpose"] == "push":
            self.held.append(msg)
            return
        self.held = [msg]
        self.start_recon(b["leader"], b["inc"], purpose)

    def start_recon(self, leader, inc, purpose):
        w = self.w
        w.req_ids += 1
        self.recon = {"leader": leader, "inc": inc, "purpose": purpose, "rid": w.req_ids,
                      "deadline": w.now + REQ_TIMEOUT, "phase": "epoch", "rounds": 0}
        self.send_epoch_end()

    def new_rid(self):
        self.w.req_ids += 1
        self.recon["rid"] = self.w.req_ids
        self.recon["deadline"] = self.w.now + REQ_TIMEOUT

    def send_epoch_end(self):
        r = self.recon
        self.new_rid()
        r["deadline"] = self.w.now + REQ_TIMEOUT
        self.w.send(self.id, r["leader"], "EPOCH_END",
                    {"rid": r["rid"], "last": epoch_cache(self.disk.log).last})

    def on_answer(self, msg):
        """EPOCH / DATA / ERROR answers to the follower's own requests."""
        r = self.recon
        b = msg.body
        if r is None or b.get("rid") != r["rid"] or msg.src != r["leader"]:
            return
        if msg.kind == "ERROR":
            self.give_up("refused")
            return
        if msg.kind == "EPOCH":
            if r["phase"] != "epoch":
                return
            if b["leader_epoch"] < self.fencing() or \
                    (r["purpose"] == "push" and b["inc"] != r["inc"]):
                self.give_up("stale leader")
                return
            self.fence = max(self.fence, b["leader_epoch"])
            log = self.disk.log
            own = epoch_cache(log)
            e = b["epoch"]
            if e < 0:
                own_first = start_of(log[0]) if log else (0, 0)
            else:
                own_first = next((start_of(x) for x in log if x.epoch > e), log_end(log))
            cut = core.truncation_point(b["end"], own_first, log_end(log))
            del own
            if cut is not None:
                r["rounds"] += 1
                if r["rounds"] > 20:
                    self.give_up("no agreement")
                    return
                self.w.trace(f"  {self.id} truncates to {cut}")
                self.disk.truncate(cut)
                self.w.stats["truncated"] += 1
                self.commit = min(self.commit, self.disk.end())
                self.send_epoch_end()
                return
            self.level = (r["leader"], b["leader_epoch"])
            self.w.stats["reconciled"] += 1
            leader = self.w.nodes[r["leader"]].driver
            if leader is not None and leader.inc == b["inc"]:
                self.w.checker.level(self.w, leader, self)
            if r["purpose"] == "push":
                self.recon = None
                held, self.held = self.held, []
                for m in held:
                    self.push(m)
            else:
                r["phase"] = "fetch"
                r["leader_epoch"] = b["leader_epoch"]
                self.send_fetch()
                held, self.held = self.held, []  # the lock let go: the pushes that waited
                for m in held:
                    self.push(m)
        elif msg.kind == "DATA":
            if r["phase"] != "fetch":
                return
            entries = b["entries"]
            if entries and start_of(entries[0]) != self.disk.end():
                self.give_up("fetch misplaced")
                return
            self.disk.write(entries)
            self.disk.sync()  # a fetched chunk is synced before the next request
            self.learn_commit(b["commit"])
            if b["more"]:
                self.send_fetch()
            else:
                r["phase"] = "join"
                self.new_rid()
                r["deadline"] = self.w.now + JOIN_TIMEOUT
                self.w.send(self.id, r["leader"], "JOIN", {
                    "rid": r["rid"], "end": self.disk.end(), "leader_epoch": r["leader_epoch"]})

    def send_fetch(self):
        r = self.recon
        self.new_rid()
        r["deadline"] = self.w.now + REQ_TIMEOUT
        self.w.send(self.id, r["leader"], "FETCH", {
            "rid": r["rid"], "end": self.disk.end(), "leader_epoch": r["leader_epoch"]})

    def on_join_answer(self, msg):
        r = self.recon
        if r is None or r["purpose"] != "catchup" or msg.src != r["leader"]:
            return
        self.recon = None

    def give_up(self, why):
        self.w.trace(f"  {self.id} gives up its {self.recon['purpose']}: {why}")
        self.recon = None
        self.held = []

    def synced(self):
        end = self.disk.durable_end()
        acks, self.acks = self.acks, []
        for leader, inc in acks:
            self.w.send(self.id, leader, "ACK", {"inc": inc, "end": end})
        if self.driver is not None:
            self.driver.synced()

    def catch_up(self):
        """Outside the ISR (as this node's view has it): catch up with the leader, JOIN."""
        v = self.view
        if (self.driver is not None or self.recon is not None or v is None
                or self.id not in v.catchup or v.leader is None):
            return False
        self.held = []
        self.start_recon(v.leader, None, "catchup")
        return True

    def tick(self):
        w = self.w
        if self.recon is not None and w.now > self.recon["deadline"]:
            self.give_up("timeout")
        d = self.driver
        if d is not None:
            if not d.stopped and w.now - self.refreshed > TTL - 1:
                d.core.stop("lease lost")
                d.run()
            d.tick()
            if d.stopped:
                self.driver = None
                self.level = None


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
        elif k in ("EPOCH", "DATA", "ERROR"):
            node.on_answer(m)
        elif k in ("JOINED", "JOIN_FAILED"):
            node.on_join_answer(m)

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
