"""The invariants the simulator checks after every step (and at the moments named).

1. Every acknowledged message is in the synced log of every replica that was in the ISR
   (etcd's, at the moment it was committed), at its place, and stays there through any
   crash those replicas have (followers ACK after their sync, the leader commits its own
   write only once it is synced).
2. The committed prefixes of all replicas are identical: each commit of any leader extends
   (or repeats) one global committed log, and every replica's log up to the committed end
   it knows is that log's prefix.
3. No two leaderships commit in the same epoch.
4. No read past the committed end: what a replica serves (its log up to the commit it
   knows) is never past the global committed end, nor past its own log; a leader commits
   nothing past its own synced end.
5. A replica that rejoins (its JOIN CAS written) holds exactly the leader's log up to its
   end, and has synced everything the leader committed; and a replica that ends its
   EPOCH_END rounds (KIP-279) with a leader holds a prefix of that leader's log.
6. No publish waits past its deadline without an answer, and none is answered twice.
"""

from __future__ import annotations


class Violation(AssertionError):
    def __init__(self, number, text):
        super().__init__(f"invariant {number}: {text}")
        self.number = number
        self.seed = None
        self.step = None


def _end(e):
    return (e.offset + e.size, e.count_before + e.msg_count)


def _prefix(log, pos):
    return [e for e in log if _end(e) <= tuple(pos)]


class Checker:
    def __init__(self):
        self.G = []  # the global committed log
        self.owner = {}  # epoch -> the leadership that committed in it
        self.acks = []  # (entry, etcd's isr when it committed)
        self.answers = {}  # publish -> answer
        self._seen = {}  # node -> (disk version, acked checked, commit)

    # ---- events ----

    def committed(self, w, d, pos):
        prefix = _prefix(d.pushed_log, pos)
        end = _end(prefix[-1]) if prefix else (0, 0)
        if end != tuple(pos):
            raise Violation(4, f"{d.node.id} commits {pos}, not an entry's end ({end})")
        if tuple(pos) > d.node.disk.durable_end():
            raise Violation(4, f"{d.node.id} commits {pos} past its synced end "
                               f"{d.node.disk.durable_end()}")
        n = min(len(prefix), len(self.G))
        if prefix[:n] != self.G[:n]:
            k = next(i for i in range(n) if prefix[i] != self.G[i])
            raise Violation(2, f"{d.node.id} (epoch {d.epoch}) commits {prefix[k]} where "
                               f"{self.G[k]} was committed")
        if len(prefix) > len(self.G):
            self.G = prefix
        owner = self.owner.setdefault(d.epoch, d.inc)
        if owner != d.inc:
            raise Violation(3, f"leaderships #{owner} and #{d.inc} ({d.node.id}) both "
                               f"commit in epoch {d.epoch}")
        w.trace(f"  {d.node.id} COMMIT {pos} (etcd isr {list(w.state.isr)})")

    def acked(self, w, d, waiter):
        e = waiter.entry
        if e not in self.G:
            raise Violation(1, f"publish {waiter.pub} acked but {e} is not committed")
        self.answer(waiter, "ok")
        self.acks.append((e, tuple(w.state.isr)))

    def answered(self, waiter, why):
        self.answer(waiter, why)

    def answer(self, waiter, why):
        if waiter.pub in self.answers:
            raise Violation(6, f"publish {waiter.pub} answered twice "
                               f"({self.answers[waiter.pub]}, {why})")
        self.answers[waiter.pub] = why

    def joined(self, w, d, node):
        log = node.disk.log
        if log != d.pushed_log[:len(log)]:
            k = next((i for i in range(min(len(log), len(d.pushed_log)))
                      if log[i] != d.pushed_log[i]), min(len(log), len(d.pushed_log)))
            raise Violation(5, f"{node.id} rejoins {d.node.id} with {log[k:k + 1]} "
                               f"where the leader has {d.pushed_log[k:k + 1]}")
        if node.disk.durable_end() < d.committed:
            raise Violation(5, f"{node.id} rejoins with synced end "
                               f"{node.disk.durable_end()} < commit {d.committed}")

    def level(self, w, d, node):
        """`node` ended its EPOCH_END rounds with leadership `d`: its log is a prefix of the
        leader's (what it pushed, written or not)."""
        log = node.disk.log
        if log != d.pushed_log[:len(log)]:
            k = next((i for i in range(min(len(log), len(d.pushed_log)))
                      if log[i] != d.pushed_log[i]), min(len(log), len(d.pushed_log)))
            raise Violation(5, f"{node.id} is level with {d.node.id} (epoch {d.epoch}) holding "
                               f"{log[k:k + 1]} where the leader has {d.pushed_log[k:k + 1]}")

    # ---- after every step ----

    def check(self, w):
        G = self.G
        g_end = _end(G[-1]) if G else (0, 0)
        for n in w.nodes.values():
            disk = n.disk
            seen = self._seen.get(n.id)
            key_same = seen is not None and seen[0] == disk.version
            start = seen[1] if key_same else 0
            if start < len(self.acks):
                held = {(e.offset, e.count_before): e for e in disk.durable}
                for e, isr in self.acks[start:]:
                    if n.id in isr and held.get((e.offset, e.count_before)) != e:
                        raise Violation(1, f"acknowledged {e} (isr {list(isr)}) is not in "
                                           f"{n.id}'s synced log")
            if not (key_same and seen[2] == n.commit):
                if n.commit > g_end:
                    raise Violation(4, f"{n.id} serves up to {n.commit}, past the committed "
                                       f"end {g_end}")
                if n.commit > disk.end():
                    raise Violation(4, f"{n.id} serves up to {n.commit} past its log")
                p = _prefix(disk.log, n.commit)
                if p != G[:len(p)]:
                    raise Violation(2, f"{n.id}'s committed prefix (to {n.commit}) differs "
                                       f"from the committed log")
            self._seen[n.id] = (disk.version, len(self.acks), n.commit)
            d = n.driver
            if d is not None:
                for wt in d.waiters:
                    if wt.deadline < w.now:
                        raise Violation(6, f"publish {wt.pub} waits past its deadline")
