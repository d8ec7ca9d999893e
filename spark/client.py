"""The nsq data source's side of the wire, without Spark: planning a window and reading it.

- `plan(Options)`: where each partition lives (nsqlookupd's `/lookup`, or the nsqd nodes
  given) and its window, from the node's `GET /topic/offsets` (the commitlog's timestamp
  search: never a scan), cut into `Split`s of at most `max_partition_bytes` each.
- `read_split(split)`: the records of one split from `GET /topic/read`, checked (CRC,
  framing, the id's partition) and turned into Arrow record batches. A node that fails,
  or whose committed end is behind the split (a follower a little behind its leader), is
  left for the next one of the split's nodes (leader first, then the ISR), from the offset
  after the last whole record received, until `retry_s` has passed without a record.

Invariants: a split holds the records whose first byte lies in [start, end), so splits cut
at any byte offsets hold every record of the window exactly once; a record is handed out
only once its CRC matched, and never twice (reads resume after the last whole record).
"""

from __future__ import annotations

import datetime
import http.client
import json
import struct
import time
import urllib.parse
import zlib
from dataclasses import dataclass, field

from nsqwire.ext import dead_control, half_control
from nsqwire.httpapi import parse_time_ns as wire_time_ns
from nsqwire.ids import PARTITION_SHIFT
HEAD = struct.Struct(">IIQQQHH")  # crc32, length, msg_id, trace_id, timestamp ns, attempts, ext_len
HEAD_SIZE = HEAD.size
FIXED_LENGTH = HEAD_SIZE - 8
READ_BYTES = 1 << 20
SCHEMA = ("topic string, partition int, offset long, msg_id string, timestamp timestamp, "
          "trace_id long, attempts int, ext map<string,string>, body binary")


class NsqSourceError(Exception):
    """A window that cannot be planned or read: the message says why and what to do."""


@dataclass
class Options:
    """The data source's options, checked (NsqSourceError on a bad one)."""

    topic: str
    lookupd: list[str] = field(default_factory=list)  # nsqlookupd HTTP addresses
    nsqd: list[str] = field(default_factory=list)  # or nsqd HTTP addresses
    since_ns: int | None = None
    until_ns: int | None = None
    partitions: frozenset[int] | None = None  # only these (a pushed filter, or the option)
    max_partition_bytes: int = 16 << 20
    timeout_s: float = 5.0  # one HTTP call
    retry_s: float = 30.0  # the longest a split (or planning) goes on trying
    before_retention: str = "error"  # or "warn"

    @classmethod
    def parse(cls, options: dict) -> "Options":
        o = {k.lower(): v for k, v in options.items()}
        topic = o.get("topic")
        if not topic:
            raise NsqSourceError("option 'topic' is required")
        lookupd, nsqd = _addresses(o.get("lookupd")), _addresses(o.get("nsqd"))
        if bool(lookupd) == bool(nsqd):
            raise NsqSourceError("give exactly one of the options 'lookupd' (nsqlookupd HTTP "
                                 "addresses) or 'nsqd' (nsqd HTTP addresses)")
        since = parse_time_ns(o["since"], "since") if o.get("since") else None
        until = parse_time_ns(o["until"], "until") if o.get("until") else None
        if since is not None and until is not None and until < since:
            raise NsqSourceError(f"'until' ({o['until']}) is before 'since' ({o['since']})")
        parts = None
        if o.get("partitions"):
            try:
                parts = frozenset(int(p) for p in o["partitions"].split(","))
            except ValueError:
                raise NsqSourceError("'partitions' is a comma-separated list of numbers") from None
        mode = o.get("beforeretention", o.get("before_retention", "error"))
        if mode not in ("error", "warn"):
            raise NsqSourceError("'before_retention' is error or warn")
        return cls(topic, lookupd, nsqd, since, until, parts,
                   _positive(o, "max_partition_bytes", 16 << 20, int),
                   _positive(o, "timeout", 5.0, float), _positive(o, "retry_timeout", 30.0, float),
                   mode)


def _addresses(text: str | None) -> list[str]:
    out = []
    for a in (text or "").split(","):
        a = a.strip().removeprefix("http://").rstrip("/")
        if a:
            out.append(a)
    return out


def _positive(o: dict, name: str, default, kind):
    raw = o.get(name, o.get(name.replace("_", "")))
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise NsqSourceError(f"'{name}' must be a positive number, not {raw!r}")
    return value


def parse_time_ns(text: str, name: str) -> int:
    """nsqwire's time (unix seconds, or ISO 8601: UTC when it has no zone), or
    NsqSourceError."""
    try:
        return wire_time_ns(text)
    except ValueError:
        raise NsqSourceError(f"'{name}' {text!r} is neither unix seconds nor ISO 8601") from None


def datetime_ns(when: datetime.datetime) -> int:
    """ns since the epoch of `when`; a naive one is local time (as PySpark hands them)."""
    if when.tzinfo is None:
        whole = int(when.replace(microsecond=0).timestamp())
        return whole * 1_000_000_000 + when.microsecond * 1000
    delta = when - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    return (delta.days * 86400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000


# ---- HTTP -------------------------------------------------------------------------------


def get_json(address: str, path: str, timeout: float) -> tuple[int, object]:
    """(status, JSON) of a GET; OSError / HTTPException when the node cannot be reached."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path, headers={"Accept": "application/vnd.nsq; version=1.0"})
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(body or b"null")
    except ValueError:
        return r.status, {"message": body[:200].decode("utf-8", "replace")}


@dataclass
class Split:
    """One Spark partition of the window: the records of `partition` whose first byte is in
    [start, end), read from `nodes` (HTTP addresses) in turn."""

    topic: str
    partition: int
    start: int
    end: int
    nodes: list[str]
    rows: int = 0  # the planned rows (exact for a whole partition, a share for a piece)


@dataclass
class Window:
    """One partition's window, as its node answered /topic/offsets."""

    partition: int
    start: int
    end: int
    count: int
    nodes: list[str]
    answer: dict


def _offsets_path(o: Options, partition: int | None) -> str:
    q = {"topic": o.topic}
    if partition is not None:
        q["partition"] = str(partition)
    if o.since_ns is not None:
        q["since_ns"] = str(o.since_ns)
    if o.until_ns is not None:
        q["until_ns"] = str(o.until_ns)
    return "/topic/offsets?" + urllib.parse.urlencode(q)


def lookup(o: Options) -> tuple[int, dict[int, str]]:
    """(partition_num, partition -> leader's HTTP address) from the first nsqlookupd that
    answers; raises NsqSourceError for an unknown topic or when none answers."""
    failures = []
    for address in o.lookupd:
        try:
            status, doc = get_json(address, "/lookup?" + urllib.parse.urlencode(
                {"topic": o.topic}), o.timeout_s)
        except (OSError, http.client.HTTPException) as e:
            failures.append(f"{address}: {e}")
            continue
        if isinstance(doc, dict) and "status_code" in doc and "data" in doc:
            status, doc = doc["status_code"], doc["data"] or {"message": doc.get("status_txt")}
        if status == 404:
            raise NsqSourceError(f"topic {o.topic!r} not found (nsqlookupd {address})")
        if status != 200 or not isinstance(doc, dict):
            failures.append(f"{address}: HTTP {status} {doc}")
            continue
        leaders = {}
        for n, p in (doc.get("partitions") or {}).items():
            leaders[int(n)] = f"{p['broadcast_address']}:{p['http_port']}"
        num = (doc.get("meta") or {}).get("partition_num")
        if num is None:  # classic nsqlookupd: each producer holds partition 0 of its own
            producers = doc.get("producers") or []
            if not producers:
                raise NsqSourceError(f"topic {o.topic!r} has no producer (nsqlookupd {address})")
            p = producers[0]
            return 1, {0: f"{p['broadcast_address']}:{p['http_port']}"}
        return int(num), leaders
    raise NsqSourceError("no nsqlookupd answered: " + "; ".join(failures))


def _window(answer: dict, fallback: list[str]) -> Window:
    nodes = list(dict.fromkeys((answer.get("replicas") or []) + fallback))
    return Window(answer["partition"], answer["start"], answer["end"], answer["count"], nodes,
                  answer)


def windows(o: Options) -> list[Window]:
    """Each partition's window (the partitions the options keep), from the nodes."""
    found: dict[int, Window] = {}
    deadline = time.monotonic() + o.retry_s
    if o.nsqd:
        failures = []
        for address in o.nsqd:
            try:
                status, doc = get_json(address, _offsets_path(o, None), o.timeout_s)
            except (OSError, http.client.HTTPException) as e:
                failures.append(f"{address}: {e}")
                continue
            if status == 404 and doc == {"message": "NOT_FOUND"}:  # the route, not the topic
                raise NsqSourceError(f"nsqd {address} has no /topic/offsets (an nsqd without "
                                     "the read API that spark/ needs)")
            if status == 404:
                failures.append(f"{address}: topic {o.topic!r} not found")
                continue
            if status != 200:
                raise NsqSourceError(f"nsqd {address}: HTTP {status} {doc}")
            for answer in doc["partitions"]:
                w = found.get(answer["partition"])
                if w is None or (w.answer["role"] == "follower" and answer["role"] != "follower"):
                    found[answer["partition"]] = _window(answer, [address])
                elif address not in w.nodes:
                    w.nodes.append(address)
        if not found:
            if all("not found" in f for f in failures):
                raise NsqSourceError(f"topic {o.topic!r} not found on nsqd {', '.join(o.nsqd)}")
            raise NsqSourceError("no nsqd answered: " + "; ".join(failures))
    else:
        while True:
            num, leaders = lookup(o)
            wanted = [n for n in range(num) if o.partitions is None or n in o.partitions]
            missing = []
            for n in wanted:
                if n in found:
                    continue
                leader = leaders.get(n)
                try:
                    if leader is None:
                        raise OSError("no leader now")
                    status, doc = get_json(leader, _offsets_path(o, n), o.timeout_s)
                    if status != 200:
                        raise OSError(f"HTTP {status} {doc}")
                    found[n] = _window(doc, [leader])
                except (OSError, http.client.HTTPException) as e:
                    missing.append(f"partition {n} ({leader}): {e}")
            if not missing:
                break
            if time.monotonic() > deadline:
                raise NsqSourceError("cannot plan the window: " + "; ".join(missing))
            time.sleep(0.5)
    return [w for n, w in sorted(found.items()) if o.partitions is None or n in o.partitions]


def check_retention(o: Options, ws: list[Window]) -> list[str]:
    """The partitions whose window starts before what retention kept: raises
    NsqSourceError (before_retention=error), else returns the warnings."""
    lost = [w for w in ws if w.answer.get("before_retention")]
    notes = [f"partition {w.partition}: the window starts before the oldest record kept "
             f"(offset {w.answer['retention_start']}, message #{w.answer['retention_start_count']}"
             f"); older messages were dropped by retention" for w in lost]
    if notes and o.before_retention == "error":
        raise NsqSourceError("; ".join(notes) + " (option before_retention=warn reads what is left)")
    return notes


def splits(o: Options, ws: list[Window]) -> list[Split]:
    """Each window cut into pieces of at most `max_partition_bytes` (any byte offsets: a
    record belongs to the piece its first byte is in)."""
    out = []
    for w in ws:
        size = w.end - w.start
        pieces = max(1, -(-size // o.max_partition_bytes))
        for k in range(pieces if size else 0):
            a = w.start + k * o.max_partition_bytes
            b = min(w.end, a + o.max_partition_bytes)
            out.append(Split(o.topic, w.partition, a, b, w.nodes,
                             w.count if pieces == 1 else w.count * (b - a) // size))
    return out


# ---- reading ----------------------------------------------------------------------------


def frame(buf: bytes, base: int, partition: int) -> tuple[list[int], int]:
    """The places (in `buf`, whose first byte is at offset `base`) of the whole records at
    its start, each checked (framing, CRC, the id's partition), and the bytes they take.
    Raises NsqSourceError on a bad record."""
    pos, n, places = 0, len(buf), []
    view = memoryview(buf)
    unpack, crc32, add = HEAD.unpack_from, zlib.crc32, places.append
    while n - pos >= HEAD_SIZE:
        crc, length, msg_id, _, _, _, ext_len = unpack(buf, pos)
        end = pos + 8 + length
        if length < FIXED_LENGTH + ext_len:
            raise NsqSourceError(f"bad record length {length} at offset {base + pos}")
        if end > n:
            break
        if crc32(view[pos + 4:end]) != crc:
            raise NsqSourceError(f"record at offset {base + pos}: checksum mismatch")
        if msg_id >> PARTITION_SHIFT != partition:
            raise NsqSourceError(f"record at offset {base + pos} has id {msg_id:016x}, "
                                 f"not of partition {partition}")
        add(pos)
        pos = end
    return places, pos


_HEX = b"0123456789abcdef"


def _field(a, places, at: int, width: int, dtype: str):
    """The big-endian integer field at `at` of every record, as a native numpy array."""
    import numpy as np

    grid = a[places[:, None] + np.arange(at, at + width)]
    return grid.view(dtype).ravel().astype(dtype.replace(">", "="))


def _bodies(block: bytes, places, used: int, ext_len):
    """The bodies as an Arrow binary array. Records are adjacent, so `block` is a binary
    array of whole records without a copy; with no ext header anywhere (the usual case)
    one Arrow kernel cuts every record's fixed head off, else each body is sliced here."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if ext_len.any():
        starts = (places + HEAD_SIZE + ext_len).tolist()
        ends = places[1:].tolist() + [used]
        return pa.array([block[s:e] for s, e in zip(starts, ends)], pa.binary())
    offsets = np.empty(len(places) + 1, np.int32)
    offsets[:-1], offsets[-1] = places, used
    records = pa.Array.from_buffers(pa.binary(), len(places),
                                    [None, pa.py_buffer(offsets), pa.py_buffer(block)])
    return pc.binary_slice(records, HEAD_SIZE, 1 << 30)


def _ext_map(ext: bytes) -> list[tuple[str, str]]:
    if not ext:
        return []
    try:
        doc = json.loads(ext)
    except ValueError:
        return [("_raw", ext.decode("utf-8", "replace"))]
    if not isinstance(doc, dict):
        return [("_raw", ext.decode("utf-8", "replace"))]
    return [(str(k), v if isinstance(v, str) else json.dumps(v)) for k, v in doc.items()]


def to_batch(topic: str, partition: int, block: bytes, base: int, places: list[int]):
    """The records of `block` (at `places`; its first byte at offset `base`) as an Arrow
    RecordBatch in SCHEMA's order and types. Fixed fields are gathered with numpy from the
    bytes and the bodies cut by an Arrow kernel, so the per-row Python work is only
    `frame`'s walk."""
    import numpy as np
    import pyarrow as pa

    n = len(places)
    a = np.frombuffer(block, np.uint8)
    p = np.array(places, np.int64)
    ext_len = _field(a, p, 34, 2, ">u2")
    ids = a[p[:, None] + np.arange(8, 16)]
    hexes = np.frombuffer(_HEX, np.uint8)
    chars = np.stack([hexes[ids >> 4], hexes[ids & 15]], axis=2).reshape(-1)
    msg_ids = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(
        np.arange(0, 16 * (n + 1), 16, dtype=np.int32)), pa.py_buffer(chars)])
    dead = None  # records that are dead letters, not messages (nsqwire.ext.dead_control)
    if ext_len.any():
        starts = p + HEAD_SIZE
        exts = [block[s:s + e] for s, e in zip(starts.tolist(), ext_len.tolist())]
        ext = pa.array([_ext_map(e) for e in exts], pa.map_(pa.string(), pa.string()))
        # no row: dead letters (nsqd/deadletters.py), halves and their decisions but the
        # commits, which are the messages (nsqd/halves.py)
        dead = [dead_control(e) is not None
                or ((c := half_control(e)) is not None and "commit" not in c) for e in exts]
    else:
        ext = pa.MapArray.from_arrays(np.zeros(n + 1, np.int32), pa.array([], pa.string()),
                                      pa.array([], pa.string()))
    batch = pa.RecordBatch.from_arrays([
        pa.repeat(pa.scalar(topic, pa.string()), n),
        pa.repeat(pa.scalar(partition, pa.int32()), n),
        pa.array(p + base, pa.int64()),
        msg_ids,
        pa.array(_field(a, p, 24, 8, ">u8").view(np.int64) // 1000, pa.timestamp("us", tz="UTC")),
        pa.array(_field(a, p, 16, 8, ">u8").view(np.int64), pa.int64()),
        pa.array(_field(a, p, 32, 2, ">u2").astype(np.int32), pa.int32()),
        ext,
        _bodies(block, p, len(block), ext_len),
    ], names=["topic", "partition", "offset", "msg_id", "timestamp", "trace_id", "attempts",
              "ext", "body"])
    if dead is not None and any(dead):
        batch = batch.filter(pa.array([not d for d in dead]))
    return batch


def _read_path(split: Split, offset: int) -> str:
    return "/topic/read?" + urllib.parse.urlencode(
        {"topic": split.topic, "partition": split.partition, "offset": offset, "end": split.end})


def read_split(split: Split, timeout_s: float = 5.0, retry_s: float = 30.0, log=None):
    """Yield the split's records as Arrow record batches, one per chunk read (see the
    module docstring)."""
    pos, attempt, failures = split.start, 0, []
    deadline = time.monotonic() + retry_s
    while pos < split.end:
        node = split.nodes[attempt % len(split.nodes)]
        try:
            host, _, port = node.rpartition(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
            try:
                conn.request("GET", _read_path(split, pos))
                r = conn.getresponse()
                if r.status == 410:  # no replica has it any more: say so at once
                    raise NsqSourceError(
                        f"partition {split.partition}: retention dropped offset {pos} while the "
                        f"window was read ({r.read()[:200].decode('utf-8', 'replace')})")
                if r.status != 200:
                    raise OSError(f"HTTP {r.status} {r.read()[:200]!r}")
                pos = max(pos, int(r.headers.get("X-NSQ-Start", pos)))
                rest = b""
                while True:
                    data = r.read(READ_BYTES)
                    if not data:
                        break
                    buf = rest + data if rest else data
                    places, used = frame(buf, pos, split.partition)
                    if places:
                        yield to_batch(split.topic, split.partition, buf[:used], pos, places)
                        deadline = time.monotonic() + retry_s  # progress: the wait starts again
                    pos += used
                    rest = buf[used:]
            finally:
                conn.close()
            if pos >= split.end:
                break
            failures.append(f"{node}: its committed end is at {pos}, before {split.end}")
        except (OSError, http.client.HTTPException) as e:
            failures.append(f"{node}: {e}")
            if log is not None:
                log(f"partition {split.partition}: reading from {node} failed at offset "
                    f"{pos} ({e}); trying the next node")
        attempt += 1
        if time.monotonic() > deadline:
            raise NsqSourceError(f"partition {split.partition} [{split.start}, {split.end}): "
                                 f"stopped at offset {pos} after {retry_s:g} s without a record: "
                                 + "; ".join(failures[-len(split.nodes) - 1:]))
        if attempt % len(split.nodes) == 0:
            time.sleep(min(1.0, 0.1 * attempt))
