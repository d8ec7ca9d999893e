"""Half messages (transactional publishing, RocketMQ's and CMQ's): the pure core of one
partition's table of them. No I/O: the partition's driver writes the records, feeds each
one committed to `apply`, asks `due` for the check-backs to make, and `roll_call_due` for
when the table must be written into the log again.

Every change is a record of the partition's log with the server key `##half` in its
header, the only record of its write request:

- a half message: its body and header, `##half` {"check": the producer's check-back URL};
  no channel delivers it;
- a commit: the half's body and header again, `##half` {"commit": the half's offset}:
  what channels deliver, at the commit's place in the log (RocketMQ rewrites a committed
  half into the real topic the same way);
- a rollback: an empty body, `##half` {"rollback": the half's offset};
- a roll-call: `##half` {"waiting": [[offset, msg_id, written_ms, checks, url], ...]}, the
  halves still undecided when it was written.

Invariants:
- a half is decided once, by the first commit or rollback record after it; a later one
  for it changes nothing (a commit sent twice is answered as the first was);
- while any half is undecided, a roll-call is written at least every ROLL_EVERY_REQUESTS
  write requests and every ROLL_EVERY_S seconds, so a new leader finds every undecided
  half by reading back the last 2 * ROLL_EVERY_REQUESTS requests (`rebuild`): the last
  roll-call, then what came after it;
- a half that is checked back MAX_CHECKS times without a decision is rolled back.
"""

from __future__ import annotations

from dataclasses import dataclass

HALF_KEY = "##half"
ROLL_EVERY_REQUESTS = 100_000
ROLL_EVERY_S = 30.0
CHECK_AFTER_S = 6.0  # a half's first check-back, after it was written
MAX_CHECKS = 10
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # between check-backs, the last repeated

WAITING, COMMITTED, ROLLED_BACK = "waiting", "committed", "rolled_back"


@dataclass
class Half:
    """One half message the table knows."""

    offset: int
    msg_id: int
    written_s: float
    url: str
    checks: int = 0
    next_check_s: float = 0.0
    state: str = WAITING


class HalfTable:
    """The halves of one partition, as the log's `##half` records say."""

    def __init__(self, check_after_s: float = CHECK_AFTER_S, max_checks: int = MAX_CHECKS):
        self.check_after_s = check_after_s
        self.max_checks = max_checks
        self.by_offset: dict[int, Half] = {}
        self.by_id: dict[int, Half] = {}
        self.committed = 0  # decided since the table was made
        self.rolled_back = 0
        self.last_roll_call = (0.0, -1)  # (time, requests count) of the last roll-call

    # ---- the records --------------------------------------------------------------

    def apply(self, offset: int, msg_id: int, written_s: float, control: dict) -> None:
        """Fold one `##half` record in (its offset, message id and write time)."""
        if "check" in control:
            self._add(Half(offset, msg_id, written_s, str(control["check"]),
                           next_check_s=written_s + self.check_after_s))
        elif "commit" in control:
            self._decide(control["commit"], COMMITTED)
        elif "rollback" in control:
            self._decide(control["rollback"], ROLLED_BACK)
        elif "waiting" in control:
            self._roll_call(control["waiting"], written_s)

    def _add(self, half: Half) -> None:
        if half.offset not in self.by_offset:
            self.by_offset[half.offset] = half
            self.by_id[half.msg_id] = half

    def _decide(self, offset, state: str) -> None:
        half = self.by_offset.get(offset) if isinstance(offset, int) else None
        if half is None or half.state != WAITING:
            return
        half.state = state
        if state == COMMITTED:
            self.committed += 1
        else:
            self.rolled_back += 1

    def _roll_call(self, waiting, written_s: float) -> None:
        """A roll-call read back: its halves are undecided (a half it does not name was
        decided before it); the ones known already keep what the table knows of them."""
        for item in waiting:
            try:
                offset, msg_id, written_ms, checks, url = item
                half = Half(int(offset), int(msg_id, 16), written_ms / 1000, str(url),
                            int(checks))
            except (TypeError, ValueError):
                continue
            half.next_check_s = max(written_s, half.written_s + self.check_after_s)
            self._add(half)
        self.last_roll_call = (written_s, self.last_roll_call[1])

    # ---- asked by the driver -------------------------------------------------------

    def state_of(self, msg_id: int) -> str | None:
        half = self.by_id.get(msg_id)
        return half.state if half is not None else None

    def waiting(self) -> list[Half]:
        return [h for h in self.by_offset.values() if h.state == WAITING]

    def due(self, now_s: float) -> list[Half]:
        """The undecided halves whose next check-back is due, oldest first."""
        return sorted((h for h in self.waiting() if h.next_check_s <= now_s),
                      key=lambda h: h.offset)

    def checked(self, half: Half, now_s: float) -> bool:
        """A check-back of `half` got no decision: the next is scheduled. False when it
        had its MAX_CHECKS: it is to be rolled back."""
        half.checks += 1
        if half.checks >= self.max_checks:
            return False
        half.next_check_s = now_s + BACKOFF_S[min(half.checks - 1, len(BACKOFF_S) - 1)]
        return True

    def roll_call_due(self, now_s: float, requests: int) -> bool:
        """Whether a roll-call must be written now: halves are undecided, and the last one
        is ROLL_EVERY_S old or ROLL_EVERY_REQUESTS requests back (`requests`: the log's
        write requests so far)."""
        if not any(h.state == WAITING for h in self.by_offset.values()):
            return False
        at_s, at_requests = self.last_roll_call
        return (now_s - at_s >= ROLL_EVERY_S
                or requests - at_requests >= ROLL_EVERY_REQUESTS)

    def rolled_call(self, now_s: float, requests: int) -> None:
        self.last_roll_call = (now_s, requests)

    def roll_call(self) -> dict:
        """The `##half` value of a roll-call of the undecided halves."""
        return {"waiting": [[h.offset, f"{h.msg_id:016x}", int(h.written_s * 1000), h.checks,
                             h.url] for h in sorted(self.waiting(), key=lambda h: h.offset)]}

    def forget_decided(self, before_offset: int) -> None:
        """Drop decided halves written before `before_offset` (kept for answering a commit
        sent again, as long as the rebuild window would still show them)."""
        for offset in [o for o, h in self.by_offset.items()
                       if o < before_offset and h.state != WAITING]:
            half = self.by_offset.pop(offset)
            self.by_id.pop(half.msg_id, None)
