"""The pieces of NSQ's HTTP APIs (nsqd 4151, nsqlookupd 4161) that are bytes, not I/O:
JSON as Go's encoding/json writes it and query strings as Go's url.ParseQuery reads
them, and the V1 answer. Both daemons' HTTP servers build their answers with these, and
every HTTP server of the project (nsqd, nsqlookupd, nsqadmin) keeps the same two deadlines:
a connection with no whole request for IDLE_S is closed (idle, or its request line and
headers coming that slowly; aiohttp's own keepalive timer is an hour), and a body that has
not come whole within BODY_S is 408 BODY_TIMEOUT."""

from __future__ import annotations

import datetime
import json
import re
from urllib.parse import unquote_to_bytes

_BAD_ESCAPE = re.compile(r"%(?![0-9a-fA-F]{2})")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
_SURROGATE = re.compile("[\ud800-\udfff]")

IDLE_S = 75.0  # a connection's next whole request comes within this, or it is closed
BODY_S = 60.0  # a request's body comes whole within this, or 408 BODY_TIMEOUT


def go_duration_ms(text: str) -> float:
    """Milliseconds of a Go duration ("1m30s", "250ms", "1.5h"), or of a plain whole number
    of milliseconds, as NSQ's flags, config files and HTTP parameters take them;
    ValueError otherwise."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return float(text)
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_MS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"invalid duration {text!r}")
    return total


def go_json(data) -> bytes:
    """JSON as Go's encoding/json writes it: compact, UTF-8, with <, >, & escaped and
    what is not valid UTF-8 (lone surrogates, e.g. from a client's IDENTIFY) as U+FFFD."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    text = (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))
    return utf8(text)


def go_json_pieces(data: dict, *lists: str):
    """go_json(data) in pieces, joined in order, each list named in `lists` an item a
    piece. One json.dumps holds the GIL and the caller for the whole value (about 100 ms
    for a trace search's 10,000 events, 150 ms for /stats at 10,000 partitions); one item
    takes microseconds, so a thread's or the loop's turn can come between (nsqd/pace.py)."""
    yield b"{"
    for i, (key, value) in enumerate(data.items()):
        yield (b"," if i else b"") + go_json(key) + b":"
        if key in lists:
            yield b"["
            for j, item in enumerate(value):
                yield (b"," if j else b"") + go_json(item)
            yield b"]"
        else:
            yield go_json(value)
    yield b"}"


V1_HEADER = {"X-NSQ-Content-Type": "nsq; version=1.0"}


def v1_answer(status: int, data, extra: dict | None = None) -> tuple[bytes, str | None]:
    """The body and content type of Go's http_api V1 answer (sent with V1_HEADER): an error
    (status != 200) is {"message": data, **extra}; bytes are JSON already; None is an empty
    body (no type); a str is text; anything else is JSON."""
    if status != 200:
        return go_json({"message": str(data), **(extra or {})}), "application/json"
    if isinstance(data, bytes):
        return data, "application/json"
    if data is None:
        return b"", None
    if isinstance(data, str):
        return utf8(data), "text/plain"
    return go_json(data), "application/json"


def utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text).encode("utf-8")


def parse_query(raw: str) -> dict[str, list[str]]:
    """Go's url.ParseQuery: `+` is a space, a bad %-escape or a `;` is an error (ValueError)."""
    out: dict[str, list[str]] = {}
    for part in raw.split("&"):
        if not part:
            continue
        if ";" in part:
            raise ValueError("invalid semicolon separator in query")
        key, _, value = part.partition("=")
        out.setdefault(_unescape(key), []).append(_unescape(value))
    return out


def _unescape(text: str) -> str:
    if _BAD_ESCAPE.search(text):
        raise ValueError(f"invalid URL escape in {text!r}")
    return unquote_to_bytes(text.replace("+", " ")).decode("utf-8", "surrogateescape")


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_DECIMAL_SECONDS = re.compile(r"(\d+)(?:\.(\d*))?")


def parse_time_ns(text: str) -> int:
    """A time given in a query or an option: unix seconds (fractions allowed) or ISO 8601
    ("Z" or an offset; UTC when it has none) -> ns since the epoch, exact to the
    microsecond. ValueError for anything else."""
    text = text.strip()
    m = _DECIMAL_SECONDS.fullmatch(text)
    if m:  # exact: a float has no room for ns at today's seconds
        whole, fraction = m.group(1), (m.group(2) or "")[:9]
        return int(whole) * 1_000_000_000 + int(fraction.ljust(9, "0"))
    try:
        return int(round(float(text) * 1e9))  # "1.7e9" and the like
    except (ValueError, OverflowError):  # not a number, or inf / nan
        pass
    when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    delta = when - _EPOCH
    return (delta.days * 86400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000
