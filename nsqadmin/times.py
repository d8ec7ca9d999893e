"""Times typed by a person (nsqadmin's search windows and a channel's replay point, and
`python -m spark.replay --since/--until`), read as UTC.

Accepted: ISO 8601 (`2026-11-26T10:00`, `2026-11-26 10:00:05`, with `Z` or an offset;
without one it is UTC), unix seconds (`1795686717.5`), a time relative to now (`-15m`,
`15m ago`, `2h`, `now`). Anything else is a BadTime whose text says what to type.
"""

from __future__ import annotations

import datetime
import re

_RELATIVE = re.compile(r"-?\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)(?:\s*ago)?")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
HELP = ("use ISO 8601 in UTC (2026-11-26T10:00:00), unix seconds (1795686717), "
        "or a time before now (-15m, 2h ago, now)")


class BadTime(ValueError):
    """A time that could not be read; str() is the message to show."""


def parse_time(text: str, now: float, what: str = "time") -> float:
    """Unix seconds of `text` (see the module docstring)."""
    t = text.strip()
    if t.lower() == "now":
        return now
    if re.fullmatch(r"\d+(\.\d+)?", t):
        value = float(t)
        if value > 1e11:  # milliseconds or nanoseconds would be far in the future
            raise BadTime(f"bad {what} {text!r}: unix seconds expected; {HELP}")
        return value
    m = _RELATIVE.fullmatch(t.lower())
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        dt = datetime.datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise BadTime(f"bad {what} {text!r}: {HELP}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.timezone.utc)
    return dt.timestamp()


def iso(seconds: float) -> str:
    """A unix time as `2026-11-26 10:00:05.123 UTC`."""
    dt = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return dt.strftime("%Y-%m-%d %H:%M:%S.") + f"{dt.microsecond // 1000:03d} UTC"
