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

import asyncio
import json
import time
from dataclasses import dataclass

import structlog

from nsqwire.ext import HALF_KEY, HALF_MARKER, half_control

log = structlog.get_logger("nsqd.halves")

ROLL_EVERY_REQUESTS = 100_000
ROLL_EVERY_S = 30.0
CHECK_AFTER_S = 6.0  # a half's first check-back, after it was written
MAX_CHECKS = 10
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # between check-backs, the last repeated

WAITING, COMMITTED, ROLLED_BACK = "waiting", "committed", "rolled_back"
SKIP, DELIVER = 0, 1  # what a channel does with a `##half` record (`role`)


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


# ---- the driver (I/O at the edges) ------------------------------------------------------

CHECK_DEADLINE_S = 5.0  # a check-back that has not answered by then got no decision
LOOP_S = 1.0  # how often the driver looks for check-backs due and roll-calls to write


def with_half(ext: bytes, value: dict) -> bytes:
    """A stored header (JSON or empty) with `##half` set to `value`."""
    header = json.loads(ext) if ext else {}
    if not isinstance(header, dict):
        header = {}
    header[HALF_KEY] = value
    return json.dumps(header, separators=(",", ":")).encode()


def role(ext: bytes) -> int | None:
    """None: no `##half` record; DELIVER for a commit (the message itself), else SKIP."""
    control = half_control(ext)
    if control is None:
        return None
    return DELIVER if "commit" in control else SKIP


class HalfNotFound(Exception):
    """No half message of that id is known to the partition (never one, or forgotten)."""


class HalfDecided(Exception):
    """The half message was decided the other way already."""


class Halves:
    """A partition's half messages while it is led here (see the module docstring).
    `writer()` gives the partition's writer; `check(url, payload)` asks a producer's
    check-back URL and returns "commit", "rollback" or None (no decision), within
    CHECK_DEADLINE_S."""

    def __init__(self, queue, writer, check, clock=time.time,
                 check_after_s: float | None = None, max_checks: int | None = None):
        self.queue = queue
        self.writer = writer
        self.check = check
        self.clock = clock
        self.table = HalfTable(CHECK_AFTER_S if check_after_s is None else check_after_s,
                               MAX_CHECKS if max_checks is None else max_checks)
        self.checks = 0  # check-backs made here
        self.expired = 0  # halves rolled back after MAX_CHECKS check-backs without a decision
        self._loading: asyncio.Task | None = None
        self._loop: asyncio.Task | None = None
        self._deciding: dict[int, asyncio.Future] = {}  # half offset -> its decision written

    def start(self) -> None:
        self._loading = asyncio.get_running_loop().create_task(self._load())
        self._loop = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        for task in (self._loading, self._loop):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._loading, self._loop) if t is not None),
                             return_exceptions=True)

    async def ready(self) -> None:
        if self._loading is not None:
            await asyncio.shield(self._loading)

    async def _load(self) -> None:
        """The table from the log's last 2 * ROLL_EVERY_REQUESTS requests (the module's
        invariants: the last roll-call is among them)."""
        found = await self.queue.marked_requests(0, HALF_MARKER, 0, 2 * ROLL_EVERY_REQUESTS)
        for entry, ext in found:
            control = half_control(ext)
            if control is not None:
                self.table.apply(entry.offset, entry.first_msg_id, entry.timestamp / 1e9,
                                 control)

    # ---- writing --------------------------------------------------------------------

    async def _write(self, body: bytes, trace_id: int, ext: bytes):
        """One `##half` record as its own request, committed and applied: its Appended."""
        writer = self.writer()
        if not writer.writable:
            raise HalfWriteFailed(f"the partition takes no write: {writer.reason}")
        appended = await writer.append([body], trace_id, ext)
        self.table.apply(appended.offset, appended.first_id, appended.timestamp / 1e9,
                         half_control(ext))
        return appended

    async def publish(self, body: bytes, trace_id: int, ext: bytes, url: str):
        """A half message: written, committed, waiting for its decision."""
        await self.ready()
        return await self._write(body, trace_id, with_half(ext, {"check": url}))

    async def decide(self, msg_id: int, commit: bool) -> str:
        """Commit (the message is written again, deliverable) or roll back the half message
        `msg_id`; its state after. A decision sent again is answered as the first was;
        HalfDecided when it went the other way, HalfNotFound when the table does not know
        it."""
        await self.ready()
        half = self.table.by_id.get(msg_id)
        if half is None:
            raise HalfNotFound(f"no half message {msg_id:016x} in this partition")
        want = COMMITTED if commit else ROLLED_BACK
        while half.state == WAITING:
            pending = self._deciding.get(half.offset)
            if pending is not None:  # another decision on its way: its outcome first
                await asyncio.shield(pending)
                continue
            self._deciding[half.offset] = done = asyncio.get_running_loop().create_future()
            try:
                if commit:
                    rec = await self._record(half.offset)
                    await self._write(rec.body, rec.trace_id,
                                      with_half(_client_header(rec.ext), {"commit": half.offset}))
                else:
                    await self._write(b"", 0, with_half(b"", {"rollback": half.offset}))
            finally:
                del self._deciding[half.offset]
                done.set_result(None)
        if half.state != want:
            raise HalfDecided(f"half message {msg_id:016x} was {half.state} already")
        return half.state

    async def _record(self, offset: int):
        from .handover import record_at

        reader = self.queue.reader(offset, read_ahead=4096)
        try:
            rec = await record_at(self.queue, reader, offset)
        finally:
            reader.close()
        if rec is None:
            raise HalfNotFound(f"the half message at offset {offset} is gone from the log")
        return rec

    # ---- check-backs and roll-calls ----------------------------------------------------

    async def _run(self) -> None:
        await self.ready()
        while True:
            await asyncio.sleep(LOOP_S)
            try:
                await self._turn()
            except Exception:  # the next turn tries again; nothing is decided by a failure
                log.exception("halves_turn_failed", path=self.queue.path)

    async def _turn(self) -> None:
        now = self.clock()
        if not self.writer().writable:
            return
        requests = self.queue.commitlog.next_log_id
        if self.table.roll_call_due(now, requests):
            await self._write(b"", 0, json.dumps({HALF_KEY: self.table.roll_call()},
                                                 separators=(",", ":")).encode())
            self.table.rolled_call(now, requests)
        for half in self.table.due(now):
            self.checks += 1
            decision = await self._ask(half)
            if half.state != WAITING:  # decided meanwhile by its producer
                continue
            if decision in ("commit", "rollback"):
                await self.decide(half.msg_id, decision == "commit")
            elif not self.table.checked(half, self.clock()):
                self.expired += 1
                await self.decide(half.msg_id, False)

    async def _ask(self, half: Half) -> str | None:
        payload = {"partition": self.queue.partition, "id": f"{half.msg_id:016x}",
                   "checks": half.checks}
        try:
            return await asyncio.wait_for(self.check(half.url, payload), CHECK_DEADLINE_S)
        except Exception as e:  # no answer, a refusal, a bad answer: no decision
            log.info("half_check_failed", url=half.url, id=payload["id"], error=repr(e)[:200])
            return None


async def check_back(url: str, payload: dict) -> str | None:
    """Ask a producer's check-back URL what became of a half message: a POST of `payload`
    as JSON, answered `{"decision": "commit" | "rollback"}` (anything else: no decision)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=payload) as r:
            if r.status != 200:
                return None
            answer = await r.json(content_type=None)
    decision = answer.get("decision") if isinstance(answer, dict) else None
    return decision if decision in ("commit", "rollback") else None


def _client_header(ext: bytes) -> bytes:
    """A half record's header without its `##half` key (a commit sets its own)."""
    header = json.loads(ext) if ext else {}
    header.pop(HALF_KEY, None)
    return json.dumps(header, separators=(",", ":")).encode() if header else b""


class HalfWriteFailed(Exception):
    """A `##half` record was not written (the partition is not writable here)."""
