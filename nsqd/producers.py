"""The idempotent producers of one partition led here: the sequences each wrote and the
answers they got (pure: no I/O; nsqd/topic.py's Partition drives it).

A producer names itself and numbers its requests to a partition, one more each request
(`##producer_id`, `##sequence`: nsqwire/ext.py). A request the partition takes is stored
with `##producer` [id, sequence] in its first record's header (`marked`), so the log is
this table's source: a partition opened here (a restart, a new leadership) rebuilds it
from the requests of the log's tail (SCAN_BYTES, SCAN_SECONDS: `replayed`), and a new
leader knows what the old one took.

What `check` says of a request (id, s):
- WRITE: the id is not in the table (a new producer, or one forgotten), or s is the next;
- an `Appended` (its `duplicate` set): s is among the KEPT last taken: the answer it got,
  and nothing is written;
- a list: s is in flight: its waiters, to which the caller adds its own;
- UNKNOWN: s's write failed without saying whether it was stored; the producer retries
  until the partition finds out (`replayed` from the log, or a reopen);
- BadSequence: s leaves a gap after the next, or is older than those kept: refused.

Bounds: at most `max_producers` a partition, the least recently written forgotten first,
and each forgotten `expiry` seconds after its last write. A forgotten producer is a new
one: its next request is written whatever its sequence.
"""

from __future__ import annotations

from diskqueue.groupcommit import Appended

from .errors import BadSequence

WRITE = "write"
UNKNOWN = "unknown"
KEPT = 5  # the last sequences of a producer whose answers are kept
# What a partition opened here rebuilds the table from: the log's last SCAN_BYTES, and every
# request written within SCAN_SECONDS of its last one (a retry comes within the client's
# retry time, nsqclient's 30 s; one in flight at a crash was written within the commit
# timeout, 10 s, of it), but at most its last SCAN_REQUESTS requests (about 2 s to read
# back: the first named request after a partition opens waits for it).
SCAN_BYTES = 32 << 20
SCAN_SECONDS = 60
SCAN_REQUESTS = 500_000
MARK_KEY = "##producer"
MARKER = b'"' + MARK_KEY.encode() + b'"'  # what a marked record's header holds
_MARK_START = b'{' + MARKER + b':["'  # how `marked` begins a header
_new = tuple.__new__


def marked(ext: bytes, producer: tuple[str, int]) -> bytes:
    """The stored header of a request's first record: `ext` (a compact JSON object or b"")
    with `##producer` [id, sequence] first (an id is [A-Za-z0-9_.:-]: nothing to escape)."""
    mark = b'{"%s":["%s",%d]' % (MARK_KEY.encode(), producer[0].encode(), producer[1])
    if not ext or ext == b"{}":
        return mark + b"}"
    return mark + b"," + ext[1:]


def mark_of(ext: bytes) -> tuple[str, int] | None:
    """(id, sequence) of a first record's stored header, None when it has none. `marked`
    puts the mark first, so it is read without decoding the JSON."""
    if not ext.startswith(_MARK_START):
        return None
    id_end = ext.find(b'",', len(_MARK_START))
    seq_end = ext.find(b"]", id_end)
    try:
        return ext[len(_MARK_START):id_end].decode(), int(ext[id_end + 2:seq_end])
    except ValueError:  # not a mark `marked` wrote
        return None


def answer_of(first_id: int, count: int, offset: int, end_offset: int) -> Appended:
    """The answer kept for a request's retries: its ids and offsets (an `Appended` with
    `duplicate` set), as little as the answer needs."""
    return _new(Appended, (first_id, count, offset, end_offset, 0, 0, (), True))


class _Producer:
    __slots__ = ("kept", "next", "written_at")

    def __init__(self):
        self.next = 0
        self.kept: dict = {}  # sequence -> Appended | list of waiters | UNKNOWN, oldest first
        self.written_at = 0.0


class ProducerTable:
    """See the module docstring. `now` is wall-clock seconds (the log's timestamps)."""

    def __init__(self, max_producers: int = 2_000, expiry: float = 3600.0):
        self.max_producers = max_producers
        self.expiry = expiry
        self._producers: dict[str, _Producer] = {}  # least recently written first
        self._expired_at = float("-inf")
        self.duplicates = 0  # requests answered again, not written

    def __len__(self) -> int:
        return len(self._producers)

    def check(self, producer_id: str, sequence: int, now: float):
        """WRITE, the answer kept, the waiters in flight or UNKNOWN; raises BadSequence."""
        self._expire(now)
        p = self._producers.get(producer_id)
        if p is None or sequence == p.next:
            return WRITE
        found = p.kept.get(sequence)
        if found is not None:
            if found is not UNKNOWN and not isinstance(found, list):
                self.duplicates += 1
            return found
        if sequence > p.next:
            raise BadSequence(f"sequence {sequence} of producer {producer_id} leaves a gap: "
                              f"the next is {p.next}")
        raise BadSequence(f"sequence {sequence} of producer {producer_id} is older than the "
                          f"last {KEPT} kept (the next is {p.next})")

    def begin(self, producer_id: str, sequence: int, now: float, waiters: list) -> None:
        """A request `check` said to WRITE went to the log: in flight, with `waiters` (the
        caller's list, which it answers: `settle`)."""
        p = self._touch(producer_id, now)
        if sequence != p.next:  # a new producer, or one forgotten: it starts here
            p.kept.clear()
        self._keep(p, sequence, waiters)

    def settle(self, producer_id: str, sequence: int, waiters: list, appended,
               maybe_stored: bool) -> None:
        """The write `begin` gave `waiters` for ended (its caller answers them): written
        (`appended`), or failed: UNKNOWN when it `maybe_stored`, else forgotten (the next
        goes back to it when it was the last taken)."""
        p = self._producers.get(producer_id)
        if p is None or p.kept.get(sequence) is not waiters:
            return  # forgotten meanwhile
        if appended is not None:
            p.kept[sequence] = answer_of(appended.first_id, appended.count, appended.offset,
                                         appended.end_offset)
        elif maybe_stored:
            p.kept[sequence] = UNKNOWN
        else:
            del p.kept[sequence]
            if p.next == sequence + 1:
                p.next = sequence

    def replayed(self, producer_id: str, sequence: int, answer, written_at: float) -> None:
        """A request the log holds, in log order (a rebuild, or finding out what UNKNOWN
        ones became): kept with its `answer` (`answer_of`, or UNKNOWN while it is not
        committed). One in flight is left to its write."""
        p = self._producers.get(producer_id)
        if p is not None and isinstance(p.kept.get(sequence), list):
            return
        p = self._touch(producer_id, written_at)
        if sequence >= p.next:
            if sequence != p.next:
                p.kept.clear()
            self._keep(p, sequence, answer)
        elif sequence in p.kept:
            p.kept[sequence] = answer

    def unknown(self) -> bool:
        """Whether any request's outcome is UNKNOWN."""
        return any(v is UNKNOWN for p in self._producers.values() for v in p.kept.values())

    def _touch(self, producer_id: str, now: float) -> _Producer:
        """The producer, made most recently written (a new one when not kept)."""
        producers = self._producers
        if producers and next(reversed(producers)) == producer_id:  # the last already
            p = producers[producer_id]
            p.written_at = max(p.written_at, now)
            return p
        p = producers.pop(producer_id, None) or _Producer()
        producers[producer_id] = p
        p.written_at = max(p.written_at, now)
        while len(self._producers) > self.max_producers:
            del self._producers[next(iter(self._producers))]
        return p

    @staticmethod
    def _keep(p: _Producer, sequence: int, value) -> None:
        kept = p.kept
        kept[sequence] = value
        p.next = sequence + 1
        if len(kept) > KEPT:  # one more than KEPT at most: one is added at a time
            del kept[next(iter(kept))]

    def _expire(self, now: float) -> None:
        """Forget the producers idle past the expiry (looked for at most once a second)."""
        if now < self._expired_at + 1.0:
            return
        self._expired_at = now
        producers = self._producers
        while producers:
            first = next(iter(producers))
            if producers[first].written_at + self.expiry > now:
                return
            del producers[first]
