"""Timelines: the events of a search grouped per message, in time order, each step with
its duration since the step before and since the first, and one line that reads as the
story ("published by 10.0.0.1:5555 -> delivered to 10.0.0.2:6666 on ch (attempt 1) ->
timed out on ch -> ... -> finished on ch"). Pure: no store, no I/O.
"""

from __future__ import annotations

from .events import (BURY, DELAY_IN, DELAY_OUT, DELIVER, DROP, FIN, NO_MESSAGE, PUB, REPLAY,
                     REQ, TIMEOUT, msg_id_hex)


def describe(e: dict) -> str:
    """One event in words."""
    kind, ch, detail = e["kind"], e["channel"], e["detail"]
    on = f" on {ch}" if ch else ""
    if kind == PUB:
        return f"published by {detail}" if detail else "published"
    if kind == DELIVER:
        return f"delivered to {detail}{on} (attempt {e['attempts']})"
    if kind == REQ:
        return f"requeued{on} (delay {detail} ms)" if detail.isdigit() else f"requeued{on} ({detail})"
    if kind == TIMEOUT:
        return f"timed out{on}"
    if kind == FIN:
        return f"finished{on}"
    if kind == DELAY_IN:
        return f"moved to the delay queue{on} (due in {detail} ms)"
    if kind == DELAY_OUT:
        return f"back from the delay queue{on}"
    if kind == REPLAY:
        return f"replayed{on} ({detail})" if detail else f"replayed{on}"
    if kind == BURY:
        return f"moved to the dead letters{on} ({detail})"
    if kind == DROP:
        return f"dropped{on} ({detail})" if detail else f"dropped{on}"
    return kind.lower()


def _public(e: dict) -> dict:
    out = dict(e)
    out["msg_id"] = msg_id_hex(e["msg_id"])
    out["trace_id"] = str(e["trace_id"])
    return out


def timelines(events: list[dict]) -> tuple[list[dict], list[dict]]:
    """(one timeline per message, in the order of its first event; the events about no one
    message: a channel emptied, a topic deleted). `events` are in time order."""
    by_id: dict[int, list[dict]] = {}
    other = []
    for e in events:
        if e["msg_id"] != NO_MESSAGE:
            by_id.setdefault(e["msg_id"], []).append(e)
        else:
            other.append(_public(e))
    out = []
    for msg_id, evs in by_id.items():
        first = evs[0]["time_ns"]
        prev = first
        steps = []
        for e in evs:
            step = _public(e)
            step["after_ms"] = round((e["time_ns"] - prev) / 1e6, 3)
            step["since_first_ms"] = round((e["time_ns"] - first) / 1e6, 3)
            step["what"] = describe(e)
            steps.append(step)
            prev = e["time_ns"]
        trace_ids = sorted({e["trace_id"] for e in evs if e["trace_id"]})
        out.append({
            "msg_id": msg_id_hex(msg_id),
            "topic": evs[0]["topic"],
            "partition": evs[0]["partition"],
            "trace_id": str(trace_ids[0]) if trace_ids else "0",
            "finished": any(e["kind"] == FIN for e in evs),
            "duration_ms": round((evs[-1]["time_ns"] - first) / 1e6, 3),
            "story": " -> ".join(s["what"] for s in steps),
            "events": steps,
        })
    return out, other
