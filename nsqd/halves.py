"""Half messages (transactional publishing, RocketMQ's and CMQ's two-phase messages) of one
partition: the pure table (`HalfTable`) and its driver (`Halves`, I/O at the edges).

Every change is a record of the partition's log with the server key `##half` in its
header, the only record of its write request, written by the partition's leader:

- a half message: its body and the client's header, `##half` {"check": the producer's
  check-back URL}; no channel delivers it;
- a commit: the half's body and header again, `##half` {"commit": the half's offset}:
  what channels deliver, at the commit's place in the log (RocketMQ rewrites a committed
  half into the real topic the same way);
- a rollback: an empty body, `##half` {"rollback": the half's offset};
- a roll-call: `##half` {"roll_call": n}, its body the JSON {"urls": [...], "waiting":
  [[offset, id hex, written_ms, checks, url index], ...]} of the n halves undecided when
  it was written.

Invariants:
- a half is decided once, by the first commit or rollback record after it; a later one
  for it changes nothing (a decision sent again is answered as the first was);
- while any half is undecided, the leader writes a roll-call at least every
  ROLL_EVERY_REQUESTS write requests and every ROLL_EVERY_S seconds (monotonic time), so
  the log's last READ_BACK_REQUESTS requests, and the ones written within READ_BACK_S of
  its last, hold the last roll-call of every undecided half: a new leader reads back
  those (`Halves._load`), the last roll-call first, then what came after it;
- a half is waiting at most MAX_WAITING at a time a partition; one checked back
  MAX_CHECKS times without a decision is rolled back (`expired`);
- retention keeps the log from the first undecided half (`kept_from`): on the leader
  (`Partition.retention_floor`) and on its replicas (a channel state's `halves_from`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections import deque
from dataclasses import dataclass

import structlog

from nsqwire.ext import HALF_KEY, HALF_MARKER, half_control

from .errors import HalfDecided, HalfFailed, HalfNotFound

log = structlog.get_logger("nsqd.halves")

ROLL_EVERY_REQUESTS = 100_000
ROLL_EVERY_S = 30.0
READ_BACK_REQUESTS = 2 * ROLL_EVERY_REQUESTS
READ_BACK_S = 4 * ROLL_EVERY_S  # slack for record times of leaders whose clocks differ
CHECK_AFTER_S = 6.0  # a half's first check-back, after it was written
MAX_CHECKS = 10
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # between check-backs, the last repeated
MAX_WAITING = 10_000  # undecided halves a partition holds; HALF is refused beyond
KEEP_BODIES_BYTES = 8 << 20  # bodies of undecided halves a driver keeps; beyond, read back
KEEP_DECIDED = 10_000  # decided halves remembered (a decision sent again is answered) ...
KEEP_DECIDED_S = 600.0  # ... for at most this long after the decision

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
    message: tuple[bytes, int, bytes] | None = None  # (body, trace id, client header) kept
    # in memory by the driver that wrote it (KEEP_BODIES_BYTES): a commit need not read it


class HalfTable:
    """The halves of one partition, as the log's `##half` records say."""

    def __init__(self, check_after_s: float = CHECK_AFTER_S, max_checks: int = MAX_CHECKS):
        self.check_after_s = check_after_s
        self.max_checks = max_checks
        self.by_offset: dict[int, Half] = {}  # in log order
        self.by_id: dict[int, Half] = {}
        self.waiting_count = 0
        self._decided: deque[tuple[float, Half]] = deque()  # (decided at, half), in order
        self.last_roll_call = (float("-inf"), -1)  # (monotonic time, requests) of the last

    # ---- the records --------------------------------------------------------------

    def apply(self, offset: int, msg_id: int, written_s: float, control: dict,
              now_s: float = 0.0) -> None:
        """Fold one half, commit or rollback record in (its offset, message id, write
        time); `now_s` dates a decision for forgetting it (`forget_decided`)."""
        if "check" in control:
            self._add(Half(offset, msg_id, written_s, str(control["check"]),
                           next_check_s=written_s + self.check_after_s))
        elif "commit" in control:
            self._decide(control["commit"], COMMITTED, now_s)
        elif "rollback" in control:
            self._decide(control["rollback"], ROLLED_BACK, now_s)

    def read_roll_call(self, written_s: float, body: bytes) -> None:
        """A roll-call read back: its halves are undecided (one it does not name was
        decided before it). Their check-backs go on where they were, none before
        `written_s`. A damaged entry is skipped (ValueError for a damaged body)."""
        call = json.loads(body)
        urls = call["urls"]
        for item in call["waiting"]:
            try:
                offset, msg_id, written_ms, checks, url = item
                half = Half(int(offset), int(msg_id, 16), written_ms / 1000, str(urls[url]),
                            int(checks))
            except (TypeError, ValueError, IndexError):
                continue
            half.next_check_s = max(written_s, half.written_s + self.check_after_s)
            self._add(half)

    def _add(self, half: Half) -> None:
        if half.offset not in self.by_offset:
            self.by_offset[half.offset] = half
            self.by_id[half.msg_id] = half
            self.waiting_count += 1

    def _decide(self, offset, state: str, now_s: float) -> None:
        half = self.by_offset.get(offset) if isinstance(offset, int) else None
        if half is None or half.state != WAITING:
            return
        half.state = state
        self.waiting_count -= 1
        self._decided.append((now_s, half))

    # ---- asked by the driver -------------------------------------------------------

    def state_of(self, msg_id: int) -> str | None:
        half = self.by_id.get(msg_id)
        return half.state if half is not None else None

    def waiting(self) -> list[Half]:
        """The undecided halves, in log order."""
        return [h for h in self.by_offset.values() if h.state == WAITING]

    def kept_from(self) -> int | None:
        """The offset of the first undecided half (retention keeps the log from it)."""
        for h in self.by_offset.values():
            if h.state == WAITING:
                return h.offset
        return None

    def due(self, now_s: float) -> list[Half]:
        """The undecided halves whose next check-back is due, in log order."""
        return [h for h in self.waiting() if h.next_check_s <= now_s]

    def checked(self, half: Half, now_s: float) -> bool:
        """A check-back of `half` got no decision: the next is scheduled. False when it
        had its MAX_CHECKS: it is to be rolled back."""
        half.checks += 1
        if half.checks >= self.max_checks:
            return False
        half.next_check_s = now_s + BACKOFF_S[min(half.checks - 1, len(BACKOFF_S) - 1)]
        return True

    def roll_call_due(self, now_s: float, requests: int) -> bool:
        """Whether a roll-call must be written now (`now_s` monotonic; `requests`: the log's
        write requests so far): halves wait, and the last roll-call is ROLL_EVERY_S old
        or ROLL_EVERY_REQUESTS requests back."""
        if not self.waiting_count:
            return False
        at_s, at_requests = self.last_roll_call
        return (now_s - at_s >= ROLL_EVERY_S
                or requests - at_requests >= ROLL_EVERY_REQUESTS)

    def rolled_call(self, now_s: float, requests: int) -> None:
        self.last_roll_call = (now_s, requests)

    def roll_call(self) -> bytes:
        """The body of a roll-call of the undecided halves."""
        urls: dict[str, int] = {}
        waiting = [[h.offset, f"{h.msg_id:016x}", int(h.written_s * 1000), h.checks,
                    urls.setdefault(h.url, len(urls))] for h in self.waiting()]
        return json.dumps({"urls": list(urls), "waiting": waiting},
                          separators=(",", ":")).encode()

    def forget_decided(self, now_s: float) -> None:
        """Forget decided halves beyond the last KEEP_DECIDED, or decided KEEP_DECIDED_S
        before `now_s`."""
        decided = self._decided
        while decided and (len(decided) > KEEP_DECIDED or decided[0][0] <= now_s - KEEP_DECIDED_S):
            half = decided.popleft()[1]
            self.by_offset.pop(half.offset, None)
            self.by_id.pop(half.msg_id, None)


def role(ext: bytes) -> int | None:
    """None: no `##half` record; DELIVER for a commit (the message itself), else SKIP."""
    control = half_control(ext)
    if control is None:
        return None
    return DELIVER if "commit" in control else SKIP


# ---- the driver (I/O at the edges) ------------------------------------------------------

CHECK_DEADLINE_S = 5.0  # a check-back that has not answered by then got no decision
MAX_CHECKING = 16  # check-backs in flight a partition
LOOP_S = 1.0  # how often the driver looks for check-backs due and roll-calls to write
READY_WAIT_S = 5.0  # a command waits this long for the read-back, then is refused
MAX_RETRY_S = 30.0  # the longest wait before a failed read-back is tried again


def with_half(ext: bytes, value: dict) -> bytes:
    """A stored header (JSON or empty) with `##half` set to `value`."""
    header = json.loads(ext) if ext else {}
    if not isinstance(header, dict):
        header = {}
    header[HALF_KEY] = value
    return json.dumps(header, separators=(",", ":")).encode()


def client_header(ext: bytes) -> bytes:
    """A half record's header without its `##half` key: the client's."""
    header = json.loads(ext) if ext else {}
    header.pop(HALF_KEY, None)
    return json.dumps(header, separators=(",", ":")).encode() if header else b""


class Halves:
    """A partition's half messages while it is led here (see the module docstring).
    `writer()` gives the partition's writer; `check(url, payload)` asks a producer's
    check-back URL and returns "commit", "rollback" or None (no decision).

    Lifecycle: `start` reads the table back from the log's tail, then runs check-backs
    and roll-calls while halves wait (an idle partition's driver only waits for a half);
    `close` stops it. Commands wait READY_WAIT_S at most for the read-back."""

    def __init__(self, queue, topic: str, writer, check, clock=time.time,
                 monotonic=time.monotonic, check_after_s: float | None = None,
                 max_checks: int | None = None):
        self.queue = queue
        self.topic = topic
        self.writer = writer
        self.check = check
        self.clock = clock
        self.monotonic = monotonic
        self.table = HalfTable(CHECK_AFTER_S if check_after_s is None else check_after_s,
                               MAX_CHECKS if max_checks is None else max_checks)
        self.committed = 0  # halves this driver committed (since the partition opened here)
        self.rolled_back = 0  # ... and rolled back, `expired` among them
        self.checks = 0  # check-backs made here
        self.expired = 0  # halves rolled back after MAX_CHECKS check-backs without a decision
        self.error: str | None = None  # why the last read-back failed, until one is done
        self._ready = asyncio.Event()
        self._wake = asyncio.Event()  # a half was written
        self._task: asyncio.Task | None = None
        self._checking: dict[int, asyncio.Task] = {}  # half offset -> its check-back
        self._deciding: dict[int, asyncio.Future] = {}  # half offset -> its decision written
        self._writing = 0  # halves on their way to the log
        self._writing_from: int | None = None  # the written end when the first of them left
        self._kept_bytes = 0  # bodies of waiting halves kept in memory (Half.message)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._checking.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def ready(self) -> None:
        """Wait for the read-back (at most READY_WAIT_S); HalfFailed when it failed or has
        not ended by then."""
        if not self._ready.is_set():
            try:
                async with asyncio.timeout(READY_WAIT_S):
                    await self._ready.wait()
            except TimeoutError:
                raise HalfFailed(self.error or "the partition's half messages are being read "
                                 "back") from None

    def kept_from(self) -> int | None:
        """Where retention must keep the log from for the halves (None: anywhere): the
        log's start until the read-back is done (an undecided half may be anywhere)."""
        if not self._ready.is_set():
            return self.queue.start_offset
        first = self.table.kept_from()
        if self._writing_from is not None:
            return self._writing_from if first is None else min(first, self._writing_from)
        return first

    async def _run(self) -> None:
        delay = LOOP_S
        while True:  # the read-back, tried again until it is done (commands say why meanwhile)
            try:
                await self._load()
                break
            except Exception as e:
                self.error = f"reading the half messages back failed: {type(e).__name__}: {e}"
                log.warning("halves_load_failed", path=self.queue.path, error=self.error,
                            retry_s=delay)
                self.table = HalfTable(self.table.check_after_s, self.table.max_checks)
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_RETRY_S)
        self.error = None
        self._ready.set()
        while True:
            if not self.table.waiting_count:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(LOOP_S)
            try:
                await self._turn()
            except Exception:  # the next turn tries again; nothing is decided by a failure
                log.exception("halves_turn_failed", path=self.queue.path)

    async def _load(self) -> None:
        """The table from the log's tail (the module's invariants): the last roll-call,
        then the records after it."""
        q = self.queue
        found = await q.marked_requests(max(q.start_offset, q.written_end - 1), HALF_MARKER,
                                        int(READ_BACK_S * 1e9), READ_BACK_REQUESTS)
        records = [(entry, control) for entry, ext in found
                   if (control := half_control(ext)) is not None]
        start = 0
        for i in range(len(records) - 1, -1, -1):
            entry, control = records[i]
            if "roll_call" in control:
                while q.committed_end <= entry.offset:  # a new leader's tail (or the one a
                    await asyncio.sleep(LOOP_S)  # power cut left): committed once its ISR has it
                rec = await self._record(entry.offset)
                self.table.read_roll_call(entry.timestamp / 1e9, rec.body)
                start = i + 1
                break
        now = self.clock()
        for entry, control in records[start:]:
            self.table.apply(entry.offset, entry.first_msg_id, entry.timestamp / 1e9, control,
                             now)
        if records:
            log.info("halves_read_back", path=q.path, records=len(records),
                     waiting=self.table.waiting_count)

    # ---- writing --------------------------------------------------------------------

    async def _write(self, body: bytes, trace_id: int, ext: bytes, control: dict):
        """One `##half` record (`control`, in `ext`) as its own request, committed, then
        folded in: its Appended."""
        writer = self.writer()
        if not writer.writable:
            raise HalfFailed(f"the partition takes no write: {writer.reason}")
        appended = await writer.append([body], trace_id, ext)
        self.table.apply(appended.offset, appended.first_id, appended.timestamp / 1e9,
                         control, self.clock())
        return appended

    async def publish(self, body: bytes, url: str, trace_id: int = 0, ext: bytes = b""):
        """A half message: written, committed, waiting for its decision."""
        await self.ready()
        if self.table.waiting_count >= MAX_WAITING:
            raise HalfFailed(f"{MAX_WAITING} half messages wait for a decision already")
        if not self._writing:
            self._writing_from = self.queue.written_end
        self._writing += 1
        try:
            control = {"check": url}
            appended = await self._write(body, trace_id, with_half(ext, control), control)
        finally:
            self._writing -= 1
            if not self._writing:
                self._writing_from = None
        half = self.table.by_offset.get(appended.offset)
        if half is not None and self._kept_bytes + len(body) <= KEEP_BODIES_BYTES:
            half.message = (body, trace_id, ext)
            self._kept_bytes += len(body)
        self._wake.set()
        return appended

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
                    body, trace_id, ext = half.message or await self._message(half.offset)
                    control = {"commit": half.offset}
                    await self._write(body, trace_id, with_half(ext, control), control)
                    self.committed += 1
                else:
                    control = {"rollback": half.offset}
                    await self._write(b"", 0, with_half(b"", control), control)
                    self.rolled_back += 1
                if half.message is not None:
                    self._kept_bytes -= len(half.message[0])
                    half.message = None
            finally:
                del self._deciding[half.offset]
                done.set_result(None)
        if half.state != want:
            raise HalfDecided(f"half message {msg_id:016x} was {half.state} already")
        return half.state

    async def _message(self, offset: int) -> tuple[bytes, int, bytes]:
        """The half at `offset` as its producer sent it, read from the log."""
        rec = await self._record(offset)
        return rec.body, rec.trace_id, client_header(rec.ext)

    async def _record(self, offset: int):
        """The committed record at `offset`: HalfFailed while it is not committed yet (a new
        leader's tail), HalfNotFound when it is gone."""
        from .handover import record_at

        if offset >= self.queue.committed_end:
            raise HalfFailed(f"the record at offset {offset} is not committed yet")
        reader = self.queue.reader(offset, read_ahead=4096)
        try:
            rec = await record_at(self.queue, reader, offset)
        finally:
            reader.close()
        if rec is None:
            raise HalfNotFound(f"the record at offset {offset} is gone from the log")
        return rec

    # ---- check-backs and roll-calls ----------------------------------------------------

    async def _turn(self) -> None:
        self.table.forget_decided(self.clock())
        if not self.writer().writable:
            return
        now, requests = self.monotonic(), self.queue.commitlog.next_log_id
        if self.table.roll_call_due(now, requests):
            control = {"roll_call": self.table.waiting_count}
            await self._write(self.table.roll_call(), 0, json.dumps({HALF_KEY: control}).encode(),
                              control)
            self.table.rolled_call(now, requests)
        for half in self.table.due(self.clock()):
            if len(self._checking) >= MAX_CHECKING:
                break
            if half.offset not in self._checking:
                self._checking[half.offset] = asyncio.get_running_loop().create_task(
                    self._check_back(half))

    async def _check_back(self, half: Half) -> None:
        """Ask the half's producer; decide as it says, or roll it back after MAX_CHECKS."""
        try:
            self.checks += 1
            decision = await self._ask(half)
            if half.state != WAITING:  # decided meanwhile by its producer
                return
            if decision in ("commit", "rollback"):
                await self.decide(half.msg_id, decision == "commit")
            elif not self.table.checked(half, self.clock()):
                self.expired += 1
                log.warning("half_expired", path=self.queue.path, id=f"{half.msg_id:016x}",
                            url=half.url, checks=half.checks)
                await self.decide(half.msg_id, False)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # not written: the next turn asks again
            log.warning("half_check_back_failed", path=self.queue.path,
                        id=f"{half.msg_id:016x}", error=repr(e)[:200])
        finally:
            self._checking.pop(half.offset, None)

    async def _ask(self, half: Half) -> str | None:
        try:
            body = half.message[0] if half.message else (await self._record(half.offset)).body
        except HalfNotFound as e:  # retention passed it (kept_from says it must not)
            log.error("half_record_missing", path=self.queue.path, error=str(e))
            return None
        payload = {"topic": self.topic, "partition": self.queue.partition,
                   "id": f"{half.msg_id:016x}", "checks": half.checks,
                   "body": base64.b64encode(body).decode()}
        try:
            async with asyncio.timeout(CHECK_DEADLINE_S):
                return await self.check(half.url, payload)
        except Exception as e:  # no answer, a refusal, a bad answer: no decision
            log.info("half_check_failed", url=half.url, id=payload["id"], error=repr(e)[:200])
            return None


async def check_back(url: str, payload: dict) -> str | None:
    """Ask a producer's check-back URL what became of a half message: a POST of `payload`
    as JSON, answered `{"decision": "commit" | "rollback"}` (anything else: no decision)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=payload, allow_redirects=False) as r:
            if r.status != 200:
                return None
            answer = await r.json(content_type=None)
    decision = answer.get("decision") if isinstance(answer, dict) else None
    return decision if decision in ("commit", "rollback") else None
