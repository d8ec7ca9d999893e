"""The pure core of a replicated partition's leader, and the epoch rules both sides use,
with no socket, file, clock or etcd call inside (etcd raft's shape); the follower's half
is `followcore.py`. The drivers (`leader.py`, `follower.py`) feed them events and do what
they say; the fault simulator (tests/sim) feeds them the same events from a simulated
disk, network and etcd.

Positions are `(offset, count)` pairs. Epochs: every leadership is a new epoch, written
to etcd by CAS before its first push (`LeaderCore` starts by asking for it).

Invariants the core keeps (tests/sim checks them after every step):
- nothing is committed past what every ISR member (as etcd has it, and every counted
  joiner) acknowledged, nor past the leader's own written end;
- the commit never moves back, and nothing is committed once stopped;
- an ISR change is decided on a state read from etcd, one at a time; a change whose
  outcome is unknown is read back before anything else is decided on it, and the members
  it would drop keep counting for the commit until etcd is seen without them;
- a follower takes a push only from the leader and epoch its log is checked level with,
  and a push that overlaps what it holds is a duplicate only when its entries are the
  ones held (epoch, timestamp, size, count), never by offset alone.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import NamedTuple

from commitlog.entry import same_entries  # noqa: F401  (a follower's duplicate test, here too)

Pos = tuple[int, int]


# ---- epochs (KIP-101 / KIP-279) ------------------------------------------------------


class EpochCache:
    """The epochs of a log: the start of each epoch's first entry, ascending. A leader keeps
    it for what it pushed (written or not), so an EPOCH_END answer never mixes its written
    log with a pushed tail of another epoch."""

    __slots__ = ("epochs", "starts")

    def __init__(self, pairs=()):
        self.epochs: list[int] = []
        self.starts: list[Pos] = []
        for epoch, start in pairs:
            self.add(epoch, start)

    def add(self, epoch: int, start: Pos) -> None:
        """An entry of `epoch` begins at `start` (after every entry already added)."""
        if not self.epochs or epoch > self.epochs[-1]:
            self.epochs.append(epoch)
            self.starts.append(tuple(start))
        elif epoch < self.epochs[-1]:
            raise ValueError(f"epoch {epoch} after {self.epochs[-1]}")

    def truncate(self, end: Pos) -> None:
        """The log was cut to `end`: epochs starting at or past it go."""
        while self.starts and self.starts[-1] >= tuple(end):
            self.epochs.pop()
            self.starts.pop()

    @property
    def last(self) -> int:
        return self.epochs[-1] if self.epochs else 0

    def end_for(self, epoch: int, log_end: Pos) -> tuple[int, Pos]:
        """KIP-279's answer: (the largest epoch held that is not above `epoch`, the start of
        the first entry of a newer epoch or `log_end`). (-1, the first entry held) when every
        epoch held is newer: the replica keeps nothing."""
        i = bisect.bisect_right(self.epochs, epoch)
        if i == 0:
            return -1, self.starts[0] if self.starts else tuple(log_end)
        end = self.starts[i] if i < len(self.starts) else tuple(log_end)
        return self.epochs[i - 1], end


def truncation_point(answer_end: Pos, own_end_of_answer_epoch: Pos, own_end: Pos) -> Pos | None:
    """Where a follower cuts its log, given the leader's EPOCH_END answer (epoch E, end) and
    its own start of the first entry newer than E: min of the two, or None when nothing
    needs cutting (its log is a prefix of the leader's as far as epochs tell)."""
    cut = min(tuple(answer_end), tuple(own_end_of_answer_epoch))
    return cut if cut < tuple(own_end) else None


# ---- the follower ---------------------------------------------------------------------


class Verdict:
    STALE = "stale"  # an epoch below the fence: refuse (E_STALE_EPOCH)
    FENCE = "fence"  # a newer epoch: persist it, then decide again
    RECONCILE = "reconcile"  # not level with this (leader, epoch): EPOCH_END rounds first
    COMMIT = "commit"  # an empty push: only the leader's commit
    APPEND = "append"  # starts at our end
    CHECK = "check"  # overlaps what we hold: a duplicate only if the entries match
    GAP = "gap"  # starts past our end


def push_verdict(fence: int, level: tuple[str, int] | None, end: Pos, leader: str,
                 epoch: int, start: Pos, n_entries: int) -> str:
    """What a follower does with a push (the first rule that applies)."""
    if epoch < fence:
        return Verdict.STALE
    if epoch > fence:
        return Verdict.FENCE
    if level != (leader, epoch):
        return Verdict.RECONCILE
    if not n_entries:
        return Verdict.COMMIT
    if tuple(start) == tuple(end):
        return Verdict.APPEND
    if tuple(start) < tuple(end):
        return Verdict.CHECK
    return Verdict.GAP


# ---- the leader -----------------------------------------------------------------------


class Action(NamedTuple):
    """What the leader's driver does: kind and its arguments.

    - ("cas", expected_state, new_state): write the partition state by CAS; answer with
      `cas_applied`, `cas_conflict` or `cas_unknown`;
    - ("read",): read the partition state from etcd; answer with `state_read` (or
      `cas_unknown` again when the read failed);
    - ("epoch", epoch): new entries carry `epoch` (diskqueue set_epoch), before any push;
    - ("writable", writable, reason): take publishes or not; not writable fails what waits;
    - ("solo", solo): commit on the local write alone (ISR = the leader, nobody counted);
    - ("joined", node, epoch) / ("join_failed", node, reason): answer a JOIN;
    - ("stop", reason): stop leading for good.
    """

    kind: str
    args: tuple


class Follower:
    """What the leader knows of one follower."""

    __slots__ = ("acked", "failed", "node", "unacked")

    def __init__(self, node: str):
        self.node = node
        self.acked: Pos = (0, 0)
        self.failed = False
        self.unacked: deque = deque()  # send times of unanswered pushes, oldest first


class LeaderCore:
    """The leader of one partition (see the module docstring). The driver calls `begin()`
    once, then the event methods; each returns nothing but appends to `actions`, which the
    driver drains (`take()`) and does in order. The hot path (`pushed`, `written`, `acked`)
    returns the commit directly instead."""

    def __init__(self, me: str, state, *, min_isr: int, written: Pos, epochs: EpochCache,
                 repl_timeout: float):
        self.me = me
        self.state = state  # the newest partition state seen (etcd's, with its revision)
        self.min_isr = min_isr
        self.repl_timeout = repl_timeout
        self.written: Pos = tuple(written)
        self.pushed: Pos = tuple(written)
        self.committed: Pos = (0, 0)
        self.epochs = epochs
        self.epoch = 0  # the epoch this leadership writes in: 0 until etcd has given it one
        self.followers: dict[str, Follower] = {}
        self.joining: set[str] = set()  # JOINs in progress (pushed to, not counted yet)
        self.counted: set[str] = set()  # joiners the commit waits for (not in the ISR yet)
        self.join_wanted: list[str] = []  # joiners level with the commit: CAS them in
        self.cas: tuple | None = None  # the ISR change in flight: ("lead"|"shrink"|"join", new)
        self.unknown = False  # the CAS in flight had an unknown outcome: reading it back
        self.stopped: str | None = None
        self.writable = False
        self.reason = "taking a new epoch"
        self.solo = False
        self.actions: list[Action] = []

    # ---- lifecycle ----

    def begin(self) -> None:
        """Ask for this leadership's epoch: the state's, raised by one, written by CAS."""
        if self.state.leader != self.me:
            self._stop(f"not the leader at epoch {self.state.epoch}")
            return
        self._propose()

    def stop(self, reason: str) -> None:
        self._stop(reason)

    def take(self) -> list[Action]:
        actions, self.actions = self.actions, []
        return actions

    # ---- the hot path ----

    def pushed_batch(self, start: Pos, end: Pos, epoch: int) -> list[str] | None:
        """A batch of this epoch goes to the disk: the followers to push it to, or None when
        it must not be pushed (it starts behind what was pushed: a local write failed after
        its batch went out; stop leading, a follower holding that tail leads)."""
        if self.stopped is not None:
            return None
        if tuple(start) != self.pushed:
            self._stop(f"local log at {list(start)} is behind what was pushed "
                       f"{list(self.pushed)} (a local write failed)")
            return None
        self.epochs.add(epoch, start)
        self.pushed = tuple(end)
        return [f.node for f in self.followers.values() if not f.failed]

    def unwritten(self, start: Pos) -> None:
        """The last batch handed to the disk, which went to no follower, was not written (a
        full disk): the log goes on from `start`, as if it had never been pushed."""
        if self.stopped is None and self.written <= tuple(start) <= self.pushed:
            self.pushed = tuple(start)
            self.epochs.truncate(start)

    def written_to(self, end: Pos) -> Pos | None:
        """The local log is written (and synced as the policy says) up to `end`."""
        self.written = max(self.written, tuple(end))
        return self._advance()

    def acked(self, node: str, end: Pos) -> Pos | None:
        """`node` holds the log up to `end`. The new commit, if it moved."""
        f = self.followers.get(node)
        if f is None:
            return None
        if f.unacked:
            f.unacked.popleft()
        if tuple(end) > f.acked:
            f.acked = tuple(end)
        return self._advance()

    def sent(self, node: str, now: float) -> None:
        f = self.followers.get(node)
        if f is not None:
            f.unacked.append(now)

    def _advance(self) -> Pos | None:
        """Commit min(own written end, every ISR member's and counted joiner's ack); nothing
        while the ISR is below min_isr (what waits then fails instead)."""
        if self.stopped is not None or not self.epoch or len(self.state.isr) < self.min_isr:
            return None
        low = self.written
        for node in self.state.isr:
            if node != self.me:
                f = self.followers.get(node)
                if f is None:
                    return None
                if f.acked < low:
                    low = f.acked
        for node in self.counted:
            f = self.followers.get(node)
            if f is None or f.acked < low:
                low = f.acked if f is not None else (0, 0)
        if low > self.committed:
            self.committed = low
            return low
        return None

    # ---- failures ----

    def failed(self, node: str, reason: str = "") -> None:
        """A push or request to `node` failed (connection, refusal, no ACK in time). An ISR
        member (or a joiner whose CAS is in flight) keeps counting for the commit until etcd
        is seen without it; a joiner is let go."""
        f = self.followers.get(node)
        if f is None or f.failed:
            return
        f.failed = True
        if node in self.state.isr or self._join_in_flight(node):
            self._propose()
            self._refresh()
            return
        if node in self.join_wanted:
            self.join_wanted.remove(node)
        was_joining = node in self.joining
        self.joining.discard(node)
        self.counted.discard(node)
        del self.followers[node]
        if was_joining:
            self.actions.append(Action("join_failed", (node, reason or "failed")))
        self._refresh()

    def refused(self, node: str, seen_epoch: int | None, reason: str = "") -> None:
        """A follower refused a push; one that has seen a newer epoch ends this leadership."""
        if seen_epoch is not None and seen_epoch > max(self.epoch, self.state.epoch):
            self._stop(f"{node} has seen epoch {seen_epoch}")
            return
        self.failed(node, reason)

    def tick(self, now: float) -> None:
        """Time passed: a follower with a push unanswered for `repl_timeout` has failed."""
        for f in list(self.followers.values()):
            if not f.failed and f.unacked and now - f.unacked[0] > self.repl_timeout:
                self.failed(f.node, f"no ack in {self.repl_timeout} s")

    # ---- the partition state ----

    def seen(self, state) -> None:
        """A partition state from etcd (the mirror's); older ones are ignored."""
        if state.epoch < self.state.epoch or (state.revision and self.state.revision
                                              and state.revision <= self.state.revision):
            return
        self._adopt(state)

    def _adopt(self, state) -> None:
        """Take `state` (etcd's newest): stop if it names another leader; a newer epoch that
        names this node (its own change, or the master's) is the epoch it writes in."""
        self.state = state
        if state.leader != self.me:
            self._stop(f"no longer the leader at epoch {state.epoch}")
            return
        if self.epoch and state.epoch > self.epoch:
            self.epoch = state.epoch
            self.actions.append(Action("epoch", (state.epoch,)))
        self._apply()

    def _apply(self) -> None:
        state = self.state
        for node in state.isr:
            if node != self.me and node not in self.followers:
                self.followers[node] = Follower(node)
        for node in list(self.followers):
            if node not in state.isr and node not in self.joining:
                del self.followers[node]
                self.counted.discard(node)
        self._propose()
        self._refresh()

    def _refresh(self) -> None:
        """Writable and solo, as the state and the changes in flight say; commit what can be."""
        failed = self._failed_members()
        if self.stopped is not None:
            writable, reason = False, self.stopped
        elif not self.epoch:
            writable, reason = False, "taking a new epoch"
        elif len(self.state.isr) < self.min_isr:
            writable, reason = False, f"isr {list(self.state.isr)} below min_isr {self.min_isr}"
        elif self.unknown and failed:
            writable, reason = False, f"etcd does not answer: cannot drop {failed} from the isr"
        else:
            writable, reason = True, ""
        if (writable, reason) != (self.writable, self.reason):
            self.writable, self.reason = writable, reason
            self.actions.append(Action("writable", (writable, reason)))
        solo = (self.stopped is None and self.epoch > 0 and self.state.isr == (self.me,)
                and self.min_isr <= 1 and not self.counted)
        if solo != self.solo:
            self.solo = solo
            self.actions.append(Action("solo", (solo,)))
        low = self._advance()
        if low is not None:
            self.actions.append(Action("commit", (low,)))

    def _failed_members(self) -> list[str]:
        return [n for n in self.state.isr
                if n != self.me and n in self.followers and self.followers[n].failed]

    # ---- ISR changes (one CAS at a time) ----

    def _propose(self) -> None:
        """Start the next change the state needs (a new epoch first, then dropping failed
        members, then joins), if none is in flight."""
        if self.cas is not None or self.stopped is not None:
            return
        state = self.state
        failed = self._failed_members()
        if not self.epoch:
            self.cas = ("lead", state.evolve(epoch=state.epoch + 1))
        elif failed:
            self.cas = ("shrink", state.evolve(
                isr=tuple(x for x in state.isr if x not in failed),
                catchup=(*(x for x in state.catchup if x not in failed), *failed),
                epoch=state.epoch + 1))
        elif self.join_wanted:
            node = self.join_wanted[0]
            if node not in state.catchup:  # the master took it off the partition meanwhile
                self.join_wanted.pop(0)
                self._join_failed(node, "no longer a replica of this partition")
                self._propose()
                return
            self.cas = ("join", state.evolve(
                isr=(*state.isr, node), catchup=tuple(x for x in state.catchup if x != node),
                epoch=state.epoch + 1))
        else:
            return
        self.actions.append(Action("cas", (state, self.cas[1])))

    def cas_applied(self, written) -> None:
        """The CAS in flight was written: `written` is the new state (with its revision)."""
        kind = self.cas[0]
        self.cas, self.unknown = None, False
        if kind == "lead":
            self.epoch = written.epoch
            self.actions.append(Action("epoch", (written.epoch,)))
        elif kind == "join":
            node = self.join_wanted.pop(0)
            self.joining.discard(node)
            self.counted.discard(node)
            self.actions.append(Action("joined", (node, written.epoch)))
        self._adopt(written)

    def cas_conflict(self, current) -> None:
        """The state had moved on (`current`: what etcd holds now, None when it is gone):
        decide again on it."""
        self.cas, self.unknown = None, False
        if current is None:
            self._stop("the partition state is gone")
        elif self.epoch and current.leader == self.me and self.me not in current.isr:
            self.state = current
            self._stop(f"dropped from the isr at epoch {current.epoch}")
        else:
            self._adopt(current)

    def cas_unknown(self) -> None:
        """The CAS (or the read back) did not answer: read the state back before deciding;
        meanwhile the members it would drop still count for the commit."""
        self.unknown = True
        self.actions.append(Action("read", ()))
        self._refresh()

    def state_read(self, current) -> None:
        """The state read back after an unknown outcome."""
        if self.cas is not None and _same_change(current, self.cas[1]):
            self.cas_applied(current)
        else:
            self.cas_conflict(current)

    # ---- joins ----

    def join_begin(self, node: str) -> bool | None:
        """A JOIN from `node`: push to it (the driver holds its pushes until the copy is
        done). False: it is in the ISR already (answered OK at once). None: its earlier
        JOIN is still going (counted, waiting for its CAS, or that CAS in flight with an
        outcome etcd may already have applied), so it keeps counting as it did; this JOIN is
        refused and the replica asks again (the driver abandons the earlier one at its
        deadline, unless its CAS is in flight)."""
        if node in self.state.isr:
            return False
        if node in self.joining:
            return None
        self.joining.add(node)
        self.counted.discard(node)
        self.followers[node] = Follower(node)
        return True

    def join_count(self, node: str, acked: Pos) -> None:
        """The copy reached `node`: from now on nothing commits without its ACK."""
        f = self.followers.get(node)
        if f is None or node not in self.joining:
            return
        f.acked = max(f.acked, tuple(acked))
        self.counted.add(node)
        self._refresh()

    def join_level(self, node: str) -> bool | None:
        """True: it acked everything committed; False: not yet; None: it failed."""
        f = self.followers.get(node)
        if f is None or f.failed or node not in self.joining:
            return None
        return f.acked >= self.committed

    def join_ready(self, node: str) -> None:
        """Level with the commit and holding every channel's state: CAS it into the ISR."""
        if node in self.joining and node not in self.join_wanted:
            self.join_wanted.append(node)
            self._propose()

    def join_abandon(self, node: str) -> None:
        """The driver gave up on a JOIN (a deadline passed); a JOIN whose CAS is in flight is
        left to the CAS's outcome."""
        if self._join_in_flight(node) or node not in self.joining:
            return
        if node in self.join_wanted:
            self.join_wanted.remove(node)
        self.joining.discard(node)
        self.counted.discard(node)
        self.followers.pop(node, None)
        self._refresh()

    def _join_in_flight(self, node: str) -> bool:
        return self.cas is not None and self.cas[0] == "join" and self.join_wanted[:1] == [node]

    def _join_failed(self, node: str, reason: str) -> None:
        self.joining.discard(node)
        self.counted.discard(node)
        if node not in self.state.isr:
            self.followers.pop(node, None)
        self.actions.append(Action("join_failed", (node, reason)))

    # ---- EPOCH_END ----

    def epoch_end(self, last_epoch: int) -> tuple[int, Pos]:
        """A catching-up replica's EPOCH_END: (largest epoch not above its `last_epoch`, the
        end of that epoch here), counting what was pushed and not yet written."""
        return self.epochs.end_for(last_epoch, self.pushed)

    # ----

    def _stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
            self.actions.append(Action("stop", (reason,)))
            for node in list(self.joining):
                self._join_failed(node, reason)
            self._refresh()


def _same_change(current, wanted) -> bool:
    """Whether etcd's `current` state is the change `wanted` (read back after an unknown
    outcome: someone else may have written the same epoch)."""
    return (current is not None and current.epoch == wanted.epoch
            and current.leader == wanted.leader and tuple(current.isr) == tuple(wanted.isr)
            and tuple(current.catchup) == tuple(wanted.catchup))
