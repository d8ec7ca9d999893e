"""Dead letters: the messages a channel gave up on, kept in the partition's own log.

A channel with `max_attempts` (> 0) buries a message delivered that many times without a
FIN: when it comes back (a REQ, a timeout, its client gone) or is about to be delivered
once more (after a restart, or a lower `max_attempts`). Every change to a channel's dead
letters is one record of its own write request in the partition's log, carrying the server
key `##dead` in its ext header (never delivered, and no client may send it):

- a dead copy: the message's body, trace id and header, plus `##dead` {"channel", "id" (the
  message's), "attempts", "cause" (why it came back the last time: "req", "timeout",
  "closed" (its client left), or "spent" (found at delivery with its attempts spent)),
  "error" (the client's last REQ reason, when it gave one), "published" (ns)}; its
  record's timestamp is when it was buried;
- a revived copy (a dead letter requeued): the dead copy's body, trace id and header, with
  `##dead` {"channel", "revive": the dead copy's offset}; that channel delivers it as a
  fresh message;
- a purge: an empty body with `##dead` {"channel", "purge": [offsets]} or {"channel",
  "purge_before": offset}.

Every channel skips every `##dead` record but the revived copies addressed to it (`role`).
So the log is the dead letters' one home: written through the partition's writer, they are
replicated, survive restarts and failover, and live as long as retention keeps the log.

`DeadIndex` is a channel's live dead copies (their offsets), a fold of those records (pure);
`DeadLetters` drives it for a channel of a partition led here: it writes the records,
applies each once committed, and rebuilds the index when the channel opens, from the
checkpoint's `dead_from`, reading one record head per write request
(DiskQueue.marked_requests).

Invariants:
- only the partition's leader writes `##dead` records, each the only record of its request,
  and only a committed one changes the index;
- a dead copy is at or after its channel's `dead_from`, and a record that removes one comes
  after it: so a rebuild from `dead_from` finds the set the old index held;
- `saved_from` (the checkpoint's `dead_from`) is the first live dead copy; with none, the
  written end, taken only when no `##dead` record is on its way;
- a message being buried stays unfinished in its channel until its dead copy is committed:
  a crash or a refused write at any moment leaves it to be delivered (or buried) again.
"""

from __future__ import annotations

import asyncio
import bisect
import json
from array import array

import structlog

from diskqueue.record import MAX_EXT
from nsqwire.ext import DEAD_KEY, DEAD_MARKER, dead_control
from nsqwire.ids import encode_msg_id

from .handover import record_at

log = structlog.get_logger("nsqd.deadletters")

MAX_ERROR_BYTES = 256  # a REQ reason longer than this is cut
MAX_ERRORS = 10_000  # REQ reasons a channel keeps for its dead copies

# Message ids of dead copies known (DeadIndex.recent), ~100 bytes each: 10 s of burials at
# the most a node buries (bench/deadletters.py), ten times the checkpoint interval.
MAX_RECENT = 10_000
REQUEUE_CHUNK = 500  # dead copies read and revived at a time
SKIP, DELIVER = 0, 1  # what a channel does with a `##dead` record (`role`)


class DeadLettersLoading(Exception):
    """The channel's dead letters are being read back from the log: ask again soon."""


def role(ext: bytes, channel: str) -> int | None:
    """None: not a `##dead` record (an ordinary message); else SKIP, or DELIVER for a
    revived copy addressed to `channel`."""
    control = dead_control(ext)
    if control is None:
        return None
    if control.get("channel") == channel and "revive" in control:
        return DELIVER
    return SKIP


def _with(ext: bytes, value: dict) -> bytes:
    """`ext` (a stored header: JSON or empty) with `##dead` set to `value`."""
    header = {}
    if ext:
        try:
            header = json.loads(ext)
        except ValueError:
            header = {}
        if not isinstance(header, dict):
            header = {}
    header[DEAD_KEY] = value
    return json.dumps(header, separators=(",", ":")).encode()


def bury_ext(ext: bytes, channel: str, msg_id: int, attempts: int, cause: str,
             error: str | None, published_ns: int) -> bytes:
    """The ext header of a message's dead copy (see the module docstring)."""
    value = {"channel": channel, "id": encode_msg_id(msg_id).decode(), "attempts": attempts,
             "cause": cause, "published": published_ns}
    if error:
        value["error"] = error
    return _with(ext, value)


def revive_ext(dead_ext: bytes, channel: str, dead_offset: int) -> bytes:
    """The ext header of a dead copy's revived copy."""
    return _with(dead_ext, {"channel": channel, "revive": dead_offset})


def purge_ext(channel: str, offsets: list[int] | None = None,
              before: int | None = None) -> bytes:
    value = {"channel": channel}
    if before is not None:
        value["purge_before"] = before
    else:
        value["purge"] = offsets
    return json.dumps({DEAD_KEY: value}, separators=(",", ":")).encode()


def reason_of(raw: bytes) -> str | None:
    """A client's REQ reason as kept: UTF-8 (bad bytes replaced), at most MAX_ERROR_BYTES."""
    if not raw:
        return None
    return raw[:MAX_ERROR_BYTES].decode("utf-8", "replace")


def _id_of(text) -> int:
    """A dead copy's `id` (16 hex characters) as a number; -1 when it is not one."""
    try:
        return int(text, 16)
    except (TypeError, ValueError):
        return -1


class DeadIndex:
    """The offsets of a channel's live dead copies, in log order (pure). `apply` folds one
    `##dead` record in; every change is idempotent, so a record seen twice changes nothing.
    `recent` maps the message ids of the last MAX_RECENT dead copies to their offsets: a
    message delivered again after a crash (its channel's progress was not saved yet) that
    is buried again is known by it (`buried_at`)."""

    __slots__ = ("channel", "offsets", "since", "recent")

    def __init__(self, channel: str, since: int):
        self.channel = channel
        self.since = since  # dead copies before this offset are not this channel's
        self.offsets = array("q")  # 8 bytes a dead letter
        self.recent: dict[int, int] = {}  # message id -> its dead copy's offset

    def apply(self, offset: int, control: dict) -> None:
        if control.get("channel") != self.channel:
            return
        offsets = self.offsets
        if "id" in control:
            if offset >= self.since:
                i = bisect.bisect_left(offsets, offset)
                if i == len(offsets) or offsets[i] != offset:
                    offsets.insert(i, offset)
                recent = self.recent
                msg_id = _id_of(control["id"])
                recent.pop(msg_id, None)
                recent[msg_id] = offset
                if len(recent) > MAX_RECENT:
                    del recent[next(iter(recent))]
        elif "revive" in control:
            self.remove([control["revive"]])
        elif "purge" in control:
            self.remove(control["purge"])
        elif "purge_before" in control:
            del offsets[:bisect.bisect_left(offsets, control["purge_before"])]

    def buried_at(self, msg_id: int) -> int | None:
        """The offset of a live dead copy of message `msg_id` among the recent ones."""
        offset = self.recent.get(msg_id)
        return offset if offset is not None and offset in self else None

    def remove(self, gone) -> None:
        offsets = self.offsets
        for offset in gone:
            if not isinstance(offset, int):
                continue
            i = bisect.bisect_left(offsets, offset)
            if i < len(offsets) and offsets[i] == offset:
                del offsets[i]

    def drop_before(self, start: int) -> int:
        """Forget the dead copies retention removed (before `start`); how many."""
        n = bisect.bisect_left(self.offsets, start)
        del self.offsets[:n]
        return n

    def __contains__(self, offset: int) -> bool:
        i = bisect.bisect_left(self.offsets, offset)
        return i < len(self.offsets) and self.offsets[i] == offset

    def __len__(self) -> int:
        return len(self.offsets)


class DeadLetters:
    """A channel's dead letters (see the module docstring). `writer()` gives the partition's
    writer (its `append`) while the channel is open."""

    def __init__(self, channel, dead_from: int, writer):
        self.channel = channel
        self.queue = channel.queue
        self.writer = writer
        self.index = DeadIndex(channel.name, dead_from)
        self.dead_from = dead_from
        self.pending = 0  # `##dead` requests written and not yet applied
        self.buried_count = 0  # dead copies committed since the channel opened here
        self.expired_count = 0  # dead letters retention removed since it opened here
        self._loading: asyncio.Task | None = None
        self._unread = False  # the index could not be read back (until the channel reopens)
        self._changing = asyncio.Lock()  # one requeue or purge at a time: none revives twice
        # msg_id -> the reason of its last REQ that gave one (MAX_ERRORS, the oldest dropped)
        self.errors: dict[int, str] = {}

    # ---- rebuild --------------------------------------------------------------

    def start(self) -> None:
        self._loading = asyncio.get_running_loop().create_task(self._load())

    @property
    def loading(self) -> bool:
        return self._loading is not None and not self._loading.done()

    async def _load(self) -> None:
        """Read the index back from the log, from `dead_from` to the written end."""
        try:
            found = await self.queue.marked_requests(self.dead_from, DEAD_MARKER)
        except Exception:  # never a channel that does not open: its dead letters unlisted
            log.exception("dead_letters_unread", topic=self.channel.topic_name,
                          partition=self.channel.partition, channel=self.channel.name)
            self._unread = True
            return
        for entry, ext in found:
            control = dead_control(ext)
            if control is not None:
                self.index.apply(entry.offset, control)
        log.info("dead_letters_read", topic=self.channel.topic_name,
                 partition=self.channel.partition, channel=self.channel.name,
                 dead_from=self.dead_from, requests=len(found), dead=len(self.index))

    async def ready(self) -> None:
        """Return once the index is read back; DeadLettersLoading if it could not be."""
        if self._loading is not None and not self._loading.done():
            await asyncio.shield(self._loading)
        if self._unread:
            raise DeadLettersLoading("the channel's dead letters could not be read back from "
                                     "its log (see the node's log)")

    def saved_from(self) -> int:
        """The checkpoint's `dead_from` (see the module invariants). It stays where it was
        while the index is read back, or when it could not be."""
        if self.loading or self._unread:
            return self.dead_from
        self.expired_count += self.index.drop_before(self.queue.start_offset)
        if self.index.offsets:
            self.dead_from = self.index.offsets[0]
        elif not self.pending:
            self.dead_from = self.queue.written_end
        return self.dead_from

    def close(self) -> None:
        if self._loading is not None:
            self._loading.cancel()

    def remember_error(self, msg_id: int, error: str) -> None:
        """A REQ's reason, for the message's dead copy."""
        errors = self.errors
        errors.pop(msg_id, None)
        errors[msg_id] = error
        if len(errors) > MAX_ERRORS:
            del errors[next(iter(errors))]

    # ---- writing ----------------------------------------------------------------

    def _append(self, body: bytes, trace_id: int, ext: bytes, done) -> None:
        """One `##dead` record as its own write request; `done(offset or None)` once it is
        committed (applied to the index first) or refused. Raises what the writer raises."""
        self.pending += 1

        def written(appended, error):
            self.pending -= 1
            if error is not None:
                done(None)
                return
            control = dead_control(ext)
            self.index.apply(appended.offset, control)
            done(appended.offset)

        try:
            writer = self.writer()
            if not writer.writable:
                raise DeadLetterWriteFailed(f"the partition takes no write: {writer.reason}")
            writer.append([body], trace_id, ext, callback=written)
        except BaseException:
            self.pending -= 1
            raise

    def bury(self, msg, cause: str, done) -> bool:
        """Write `msg`'s dead copy, with the reason of its last REQ that gave one;
        `done(buried: bool)` once committed or refused. False
        (and `done` never called) when the partition takes no write now. A message with a
        live dead copy already (buried, then a crash before its channel saved that) is not
        written again: `done(True)` soon."""
        if self.index.buried_at(msg.msg_id) is not None:
            self.errors.pop(msg.msg_id, None)
            asyncio.get_running_loop().call_soon(done, True)
            return True
        error = self.errors.get(msg.msg_id)
        ext = bury_ext(msg.ext, self.channel.name, msg.msg_id, msg.attempts, cause, error,
                       msg.timestamp)
        if len(ext) > MAX_EXT:  # no room for `##dead` beside the message's own header
            ext = bury_ext(b"", self.channel.name, msg.msg_id, msg.attempts, cause, error,
                           msg.timestamp)

        def written(offset):
            if offset is not None:
                self.buried_count += 1
                self.errors.pop(msg.msg_id, None)
            done(offset is not None)
        try:
            self._append(msg.body, msg.trace_id, ext, written)
        except Exception:
            return False
        return True

    def _start(self, body: bytes, trace_id: int, ext: bytes) -> asyncio.Future:
        """One `##dead` record: a future of its offset (None: not committed)."""
        fut = asyncio.get_running_loop().create_future()

        def done(offset):
            if not fut.done():
                fut.set_result(offset)
        self._append(body, trace_id, ext, done)
        return fut

    async def _write(self, body: bytes, trace_id: int, ext: bytes) -> None:
        """One `##dead` record, awaited: its offset. Raises when it was not written."""
        if await self._start(body, trace_id, ext) is None:
            raise DeadLetterWriteFailed("the partition did not commit the record")

    async def requeue(self, offsets: list[int]) -> int:
        """Revive these dead copies (each a revived copy the channel delivers), REQUEUE_CHUNK
        at a time; how many. Raises DeadLetterWriteFailed when one was not written."""
        async with self._changing:
            return await self._requeue(offsets)

    async def _requeue(self, offsets: list[int]) -> int:
        n = 0
        for i in range(0, len(offsets), REQUEUE_CHUNK):
            chunk = offsets[i:i + REQUEUE_CHUNK]
            writes = [self._start(rec.body, rec.trace_id,
                                  revive_ext(rec.ext, self.channel.name, offset))
                      for offset, rec in zip(chunk, await self.records(chunk))
                      if rec is not None and offset in self.index]
            done = await asyncio.gather(*writes)
            n += sum(offset is not None for offset in done)
            if None in done:
                raise DeadLetterWriteFailed(f"{n} requeued, then the partition did not "
                                            "commit a record")
        return n

    async def purge(self, offsets: list[int] | None) -> int:
        """Drop these dead copies (None: every one listed now); how many."""
        async with self._changing:
            return await self._purge(offsets)

    async def _purge(self, offsets: list[int] | None) -> int:
        if offsets is None:
            if not self.index.offsets:
                return 0
            n = len(self.index)
            await self._write(b"", 0, purge_ext(self.channel.name,
                                                before=self.index.offsets[-1] + 1))
            return n
        offsets = [o for o in offsets if o in self.index]
        if offsets:
            await self._write(b"", 0, purge_ext(self.channel.name, offsets))
        return len(offsets)

    # ---- reading ----------------------------------------------------------------

    async def find(self, msg_id: int) -> int | None:
        """The offset of the live dead copy with this id, None when there is none."""
        entry = await self.queue.find("msg_id", msg_id)
        if entry is None or entry.first_msg_id != msg_id or entry.offset not in self.index:
            return None
        return entry.offset

    async def record(self, offset: int):
        """The dead copy's record at `offset`, None when the log no longer has it."""
        return (await self.records([offset]))[0]

    async def records(self, offsets: list[int]) -> list:
        """The records at `offsets` (None for each the log no longer has), one reader."""
        reader = self.queue.reader(offsets[0] if offsets else 0, read_ahead=4096)
        try:
            return [await record_at(self.queue, reader, o) for o in offsets]
        finally:
            reader.close()

    async def page(self, after: int, limit: int) -> list:
        """Up to `limit` dead copies' records past offset `after`, in log order."""
        offsets = self.index.offsets
        i = bisect.bisect_right(offsets, after)
        return [r for r in await self.records(offsets[i:i + limit]) if r is not None]


class DeadLetterWriteFailed(Exception):
    """A `##dead` record was not committed (the partition lost its leader, or its disk)."""
