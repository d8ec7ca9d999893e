"""`FollowerCore`: every decision of a partition's follower, with no socket, file, clock or
etcd call inside (the follower's half of isr/core.py). The driver (isr/follower.py) and the
fault simulator (tests/sim) feed it the same events and do the actions it asks for, in
order: the driver with the partition's DiskQueue and the leader's connection, the
simulator with its simulated disk and network.

The log is changed by one job at a time (the `slot`): a group of pushes, a fence, the
EPOCH_END rounds with their truncations, a fetched chunk, a restart at the leader's start.
The answers to the follower's requests (EPOCH_END, FETCH, JOIN) carry the request id
they were asked with; an answer to a request no longer wanted is ignored.

Invariants:
- nothing of an epoch below `fence` is taken, and a higher epoch is persisted (the
  "fence" action done) before anything of it is written;
- pushes are appended only while the log is level with the pushing (leader, epoch): a new
  leader or epoch first runs the EPOCH_END rounds (KIP-101, KIP-279), which cut the log
  until it is a prefix of that leader's, then say it is level;
- pushes are taken in arrival order, one group at a time (consecutive pushes that continue
  each other go as one append), and each is answered once; a push that overlaps what the
  log holds is a duplicate only when the log's job finds its entries are the ones held;
- outside the ISR it catches up (the rounds, FETCH until the lag is small, JOIN), and a
  step that fails starts it again after a backoff: a request without an answer is failed
  by the driver's deadline, so nothing waits for good.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from . import core

Pos = tuple[int, int]

RETRY_FIRST = 0.05  # s: the first pause before a failed catch-up starts again
RETRY_MAX = 1.0  # s: the longest


class Push(NamedTuple):
    """One PUSH as the core sees it; `token` is the driver's (its frame and answer)."""

    leader: str
    epoch: int
    start: Pos
    end: Pos  # after its entries (its start when it has none)
    n: int  # entries
    commit: Pos  # the leader's commit when it sent it
    token: object


class Step(NamedTuple):
    """What the follower's driver does: kind and its arguments.

    - ("answer", pushes, result): answer each push; result ("ack", end), ("stale", fence),
      ("gap", end), ("failed", reason, end) or ("error", exception, end) (the log's);
    - ("commit", pos): readers may see the log up to `pos` (never past its written end);
    - ("append", pushes): append the pushes' entries as one batch; answer `written`;
    - ("fence", epoch): persist `epoch` as the fence; answer `fenced`;
    - ("epoch_end", rid, leader, epoch, last_epoch): ask `leader`; answer `epoch_answer`
      (with the log's own start of its first entry newer than the epoch found) or
      `request_failed`;
    - ("truncate", pos): cut the log back to `pos`; answer `truncated`;
    - ("fetch", rid, leader, epoch, pos): ask for what follows `pos`; answer `fetched`,
      `out_of_range` or `request_failed`;
    - ("append_fetched", rid): append the chunk that answer brought; answer `written`;
    - ("restart", pos): drop the log and go on empty at `pos`; answer `restarted`;
    - ("join", rid, leader, epoch, pos): ask to join the ISR; answer `joined` or
      `request_failed`;
    - ("retry", delay): call `retry()` after `delay` seconds;
    - ("level", leader, epoch): the log is now level with that leadership (for the record).
    """

    kind: str
    args: tuple


class _CatchUp:
    __slots__ = ("chunk", "delay", "epoch", "leader", "phase", "rid")

    def __init__(self, leader: str, epoch: int):
        self.leader = leader
        self.epoch = epoch
        # "wait" for the slot, "fence", "rounds", "fetch", "fetched" (a chunk waits for
        # the slot), "append", "restart" (the slot), "join", "retry"
        self.phase = "wait"
        self.rid = 0
        self.delay = RETRY_FIRST
        self.chunk: tuple | None = None  # (start, commit, leader_end, out_of_range start)


class _Rounds:
    __slots__ = ("epoch", "leader", "owner", "rid")

    def __init__(self, leader: str, epoch: int, owner):
        self.leader = leader
        self.epoch = epoch
        self.rid = 0
        self.owner = owner  # the push it is run for, or the catch-up


class FollowerCore:
    """The follower of one partition (see the module docstring). Events are the methods;
    each appends `Step`s, which the driver drains (`take()`) and does in order."""

    def __init__(self, *, fence: int, end: Pos, last_epoch: int, join_lag: int):
        self.fence = fence
        self.end: Pos = tuple(end)  # the log's written end
        self.last_epoch = last_epoch
        self.join_lag = join_lag
        self.level: tuple[str, int] | None = None  # (leader, epoch) the log is level with
        self.pending: deque[Push] = deque()
        self.slot = None  # the job that holds the log: a push group, a _Rounds, a _CatchUp
        self.rounds: _Rounds | None = None
        self.catchup: _CatchUp | None = None
        self.closed = False
        self._rid = 0
        self.steps: list[Step] = []

    def take(self) -> list[Step]:
        steps, self.steps = self.steps, []
        return steps

    def _do(self, kind: str, *args) -> None:
        self.steps.append(Step(kind, args))

    def _ask(self, kind: str, leader: str, epoch: int, *args) -> int:
        self._rid += 1
        self._do(kind, self._rid, leader, epoch, *args)
        return self._rid

    # ---- pushes ----

    def push(self, p: Push) -> None:
        """A PUSH arrived (in arrival order)."""
        if p.epoch < self.fence or self.closed:
            self._do("answer", (p,), ("stale", self.fence))
            return
        self.pending.append(p)
        self._next()

    def _next(self) -> None:
        """Give the free slot to what waits: a catch-up step first, then the pushes."""
        while self.slot is None and not self.closed:
            cu = self.catchup
            if cu is not None and cu.phase in ("wait", "fetched"):
                self._catch_up_go(cu)
                continue
            if not self.pending:
                return
            p = self.pending[0]
            v = core.push_verdict(self.fence, self.level, self.end, p.leader, p.epoch, p.start,
                                  p.n)
            if v == core.Verdict.STALE:  # the fence rose while it waited
                self.pending.popleft()
                self._do("answer", (p,), ("stale", self.fence))
            elif v in (core.Verdict.FENCE, core.Verdict.RECONCILE):
                self.slot = p
                self._prepare(p)
            elif v == core.Verdict.COMMIT:
                self.pending.popleft()
                self._do("commit", min(p.commit, self.end))
                self._do("answer", (p,), ("ack", self.end))
            elif v == core.Verdict.GAP:
                self.pending.popleft()
                self._do("answer", (p,), ("gap", self.end))
            else:  # APPEND, or CHECK (the log's job tells a duplicate from a divergence)
                group = [self.pending.popleft()]
                while self.pending and _continues(group[-1], self.pending[0]):
                    group.append(self.pending.popleft())
                self.slot = group
                self._do("append", tuple(group))

    def _prepare(self, p: Push) -> None:
        """The first push waits for its fence, then for the rounds with its leader."""
        if p.epoch < self.fence:  # the fence rose meanwhile: refused by _next
            self._free()
        elif p.epoch > self.fence:
            self._do("fence", p.epoch)
        elif self.level != (p.leader, p.epoch):
            self._start_rounds(p.leader, p.epoch, p)
        else:
            self.slot = None
            self._next()

    def written(self, end: Pos, last_epoch: int, error: object = None,
                diverged: bool = False) -> None:
        """The log's append (a push group, or a fetched chunk) is done: written and synced
        as the policy says (error None, a duplicate included), or refused (`error`: the
        log's; `diverged`: the pushes overlap entries that are not theirs)."""
        job, self.slot = self.slot, None
        self.end, self.last_epoch = tuple(end), last_epoch
        if isinstance(job, list):
            if error is None:
                self._do("commit", min(job[-1].commit, self.end))
                self._do("answer", tuple(job), ("ack", self.end))
            else:
                if diverged:
                    self.level = None  # the rounds run before anything more is taken
                self._do("answer", tuple(job), ("error", error, self.end))
        elif isinstance(job, _CatchUp) and job is self.catchup:
            if error is not None:
                self._retry(job)
            else:
                _start, commit, leader_end, _ = job.chunk
                job.chunk = None
                self._do("commit", min(commit, self.end))
                self._after_fetch(job, leader_end)
        self._next()

    # ---- the fence and the EPOCH_END rounds ----

    def fenced(self, epoch: int, error: object = None) -> None:
        """The fence file holds `epoch` (or writing it failed)."""
        job = self.slot
        if error is None:
            self.fence = max(self.fence, epoch)
        if isinstance(job, Push):
            if error is not None:
                return self._fail_first(job, f"fence: {error}")
            self._prepare(job)
        elif isinstance(job, _CatchUp):
            if job is not self.catchup:
                return self._free()
            if error is not None:
                self.slot = None
                self._retry(job)
                return self._next()
            job.phase = "rounds"
            self._start_rounds(job.leader, job.epoch, job)

    def _start_rounds(self, leader: str, epoch: int, owner) -> None:
        self.rounds = _Rounds(leader, epoch, owner)
        self._round()

    def _round(self) -> None:
        r = self.rounds
        r.rid = self._ask("epoch_end", r.leader, r.epoch, self.last_epoch)

    def epoch_answer(self, rid: int, found: int, leader_end: Pos, own_end: Pos) -> None:
        """The leader answered EPOCH_END: its largest epoch not above ours (`found`, -1 when
        it has none) ends at `leader_end` in its log; ours of the first entry newer than
        `found` is `own_end`."""
        r = self.rounds
        if r is None or rid != r.rid:
            return
        if r.owner is None:  # its catch-up was dropped: nothing more for it
            self.rounds = None
            return self._free()
        cut = core.truncation_point(leader_end, own_end, self.end)
        if cut is not None:
            self._do("truncate", cut)
            return
        self.rounds = None
        self.level = (r.leader, r.epoch)
        self._do("level", r.leader, r.epoch)
        owner = r.owner
        if isinstance(owner, Push):
            self.slot = None
            self._next()
        elif owner is self.catchup:
            self.slot = None
            owner.phase = "fetch"
            owner.rid = self._ask("fetch", owner.leader, owner.epoch, self.end)
            self._next()
        else:
            self._free()

    def truncated(self, end: Pos, last_epoch: int, error: object = None) -> None:
        """The log was cut back to `end` (or the cut failed)."""
        self.end, self.last_epoch = tuple(end), last_epoch
        if error is not None:
            return self._rounds_failed(f"truncate: {error}")
        if self.rounds is None or self.rounds.owner is None:
            self.rounds = None
            return self._free()
        self._round()

    def _rounds_failed(self, reason: str, newer_epoch: int | None = None) -> None:
        r, self.rounds = self.rounds, None
        owner = r.owner if r is not None else None
        if isinstance(owner, Push):
            self._fail_first(owner, f"reconcile: {reason}")
        elif owner is not None and owner is self.catchup:
            self.slot = None
            if newer_epoch is not None and newer_epoch > owner.epoch:
                owner.epoch = newer_epoch
            self._retry(owner)
            self._next()
        else:
            self._free()

    def _fail_first(self, p: Push, reason: str) -> None:
        """The first push's fence or rounds failed: refuse it alone, go on with the rest."""
        if self.pending and self.pending[0] is p:
            self.pending.popleft()
            self._do("answer", (p,), ("failed", reason, self.end))
        self._free()

    def _free(self) -> None:
        self.slot = None
        self._next()

    # ---- requests that failed ----

    def request_failed(self, rid: int, reason: str, newer_epoch: int | None = None) -> None:
        """A request got no answer in time, or the leader refused it (`newer_epoch`: it
        named an epoch above the one asked for)."""
        if self.rounds is not None and rid == self.rounds.rid:
            self._rounds_failed(reason, newer_epoch)
            return
        cu = self.catchup
        if cu is not None and rid == cu.rid and cu.phase in ("fetch", "join"):
            if newer_epoch is not None and newer_epoch > cu.epoch:
                cu.epoch = newer_epoch
            self._retry(cu)

    # ---- catching up, outside the ISR ----

    def follow(self, leader: str | None, epoch: int, outside: bool) -> None:
        """The partition's state: led by `leader` at `epoch`; `outside`: this node is a
        replica outside the ISR (it catches up and joins). A new leader or epoch starts the
        catch-up again."""
        cu = self.catchup
        if not outside or leader is None:
            if cu is not None:
                self._drop_catchup()
            return
        if cu is not None and (cu.leader != leader or epoch > cu.epoch):
            self._drop_catchup()  # (an epoch below the catch-up's is an older view)
            cu = None
        if cu is None:
            self.catchup = _CatchUp(leader, epoch)
            self._next()

    def _drop_catchup(self) -> None:
        cu, self.catchup = self.catchup, None
        if self.rounds is not None and self.rounds.owner is cu:
            self.rounds.owner = None  # its answers are ignored; the slot frees when they end

    def retry(self) -> None:
        """The pause after a failed catch-up is over: start again."""
        cu = self.catchup
        if cu is not None and cu.phase == "retry":
            cu.phase = "wait"
            self._next()

    def _retry(self, cu: _CatchUp) -> None:
        cu.phase, cu.rid, cu.chunk = "retry", 0, None
        self._do("retry", cu.delay)
        cu.delay = min(cu.delay * 2, RETRY_MAX)

    def _catch_up_go(self, cu: _CatchUp) -> None:
        """(The slot is free) run the catch-up's next step that needs the log."""
        self.slot = cu
        if cu.phase == "wait":
            if cu.epoch > self.fence:
                cu.phase = "fence"
                self._do("fence", cu.epoch)
            else:
                cu.phase = "rounds"
                self._start_rounds(cu.leader, cu.epoch, cu)
            return
        start, _commit, _leader_end, restart_at = cu.chunk
        if restart_at is not None:
            if restart_at[0] <= self.end[0]:  # a start at or before ours makes no sense here
                self.slot = None
                return self._retry(cu)
            cu.phase = "restart"
            self._do("restart", restart_at)
            return
        if self.level != (cu.leader, cu.epoch) or self.end != start:
            self.slot = None  # a push or its rounds came between: fetch again
            cu.phase, cu.chunk = "fetch", None
            cu.rid = self._ask("fetch", cu.leader, cu.epoch, self.end)
            return
        cu.phase = "append"
        self._do("append_fetched", cu.rid)

    def fetched(self, rid: int, start: Pos, n: int, leader_end: Pos, commit: Pos) -> None:
        """The leader answered FETCH: `n` entries from `start` (the driver keeps them), its
        written end and commit."""
        cu = self.catchup
        if cu is None or rid != cu.rid or cu.phase != "fetch":
            return
        if not n:
            return self._after_fetch(cu, leader_end)
        cu.phase, cu.chunk = "fetched", (tuple(start), tuple(commit), tuple(leader_end), None)
        self._next()

    def out_of_range(self, rid: int, start: Pos) -> None:
        """The leader's log starts at `start`, past what we asked for (its retention dropped
        what follows our end): drop ours and take its history from there."""
        cu = self.catchup
        if cu is None or rid != cu.rid or cu.phase != "fetch":
            return
        cu.phase, cu.chunk = "fetched", (None, None, None, tuple(start))
        self._next()

    def restarted(self, end: Pos, last_epoch: int, error: object = None) -> None:
        """The log was dropped and goes on at `end` (or that failed)."""
        job, self.slot = self.slot, None
        self.end, self.last_epoch = tuple(end), last_epoch
        if isinstance(job, _CatchUp) and job is self.catchup:
            if error is not None:
                self._retry(job)
            else:
                job.phase, job.chunk = "fetch", None
                job.rid = self._ask("fetch", job.leader, job.epoch, self.end)
        self._next()

    def _after_fetch(self, cu: _CatchUp, leader_end: Pos) -> None:
        if leader_end[0] - self.end[0] <= self.join_lag:
            cu.phase = "join"
            cu.rid = self._ask("join", cu.leader, cu.epoch, self.end)
        else:
            cu.phase = "fetch"
            cu.rid = self._ask("fetch", cu.leader, cu.epoch, self.end)

    def joined(self, rid: int) -> None:
        """The leader took this node into the ISR (or says it is in it)."""
        cu = self.catchup
        if cu is not None and rid == cu.rid and cu.phase == "join":
            self.catchup = None

    # ---- closing ----

    def close(self) -> None:
        """Take nothing more: what waits is answered stale."""
        self.closed = True
        self.catchup = None
        self.rounds = None
        pending, self.pending = tuple(self.pending), deque()
        if pending:
            self._do("answer", pending, ("stale", self.fence))


def _continues(a: Push, b: Push) -> bool:
    """Whether push `b` goes in one append with `a`: same leadership, entries, and it
    starts where `a` ends."""
    return (b.leader, b.epoch) == (a.leader, a.epoch) and b.n > 0 and b.start == a.end
