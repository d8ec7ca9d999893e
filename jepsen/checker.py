"""Checkers over a history (a list of operations, `history.read`): each returns a dict
with `valid` (True, False, or "skipped") and its figures, named plainly.

- total_queue: every acknowledged enqueue is dequeued (`lost` must be 0), nothing is
  dequeued that was never attempted (`unexpected` 0); duplicates are counted, not
  failed (delivery is at least once). An enqueue that ended `info` or `fail` and was
  dequeued anyway is `recovered` (an indeterminate one may have happened; a `fail`
  one must not: it counts as `unexpected`). `stored_twice`: values delivered under two
  or more message ids (a retried publish written again); those of idempotent producers
  (the enqueue's `named`, nsqclient's) must be none (`named_stored_twice` 0). With
  poison messages (`--poison`), an acknowledged one is not lost when it is among the
  channel's dead letters (`dead` operations); `dead_twice` counts values buried twice,
  `dead_not_poison` ones buried that a consumer never failed (delivered max_attempts
  times without a FIN through faults): figures, not failures. With half messages
  (`--halves`, jepsen/halves.py), a value of a rollback kind must never be delivered
  (dequeued, rejected or buried), whatever its enqueue's outcome (`rolled_back_delivered`
  must be 0), and is never lost; an acknowledged one of a commit kind is lost unless
  dequeued, as any acknowledged enqueue. `check_backs`: the check-backs answered.
- order: per key, the first deliveries of its messages have increasing `seq`
  (a redelivery of an earlier message is a duplicate, not a reordering); half messages
  are left out (one is delivered where its commit is written, which the check-back may
  write after the key's later messages). Only for an ordered topic; "skipped" otherwise.
- availability: the enqueue success rate, latency percentiles, and both per second.
- failover: per fault that took partition leaders away, the time from the fault's start
  to the first acknowledged keyed publish of each such partition invoked after it.
- liveness: after the final heal, every partition takes an acknowledged write within a
  bound (the runner measures it while the producers run).
- replicas (jepsen/replicas.py, every R>1 run): the nodes' copies of each partition
  compared record by record after a clean stop.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from jepsen.halves import rolled_back


def pairs(history: list[dict]) -> list[tuple[dict, dict | None]]:
    """Each enqueue invoke with its completion (None: it never completed, `info`)."""
    open_: dict[str, int] = {}  # process -> index in out of its pending invoke
    out: list[list] = []
    for op in history:
        if op["f"] != "enqueue":
            continue
        if op["type"] == "invoke":
            open_[op["process"]] = len(out)
            out.append([op, None])
        elif op["process"] in open_:
            out[open_.pop(op["process"])][1] = op
    return [(inv, done) for inv, done in out]


def total_queue(history: list[dict]) -> dict:
    attempted, acknowledged, failed, indeterminate = set(), set(), set(), set()
    named = set()
    for inv, done in pairs(history):
        vid = inv["value"]["id"]
        attempted.add(vid)
        if inv["value"].get("named"):
            named.add(vid)
        kind = done["type"] if done else "info"
        {"ok": acknowledged, "fail": failed, "info": indeterminate}[kind].add(vid)
    deliveries = Counter(op["value"].get("id") for op in history
                         if op["f"] == "dequeue" and op["type"] == "ok")
    dequeued = set(deliveries)
    buried = Counter(op["value"].get("id") for op in history if op["f"] == "dead")
    dead = set(buried)
    poison = {inv["value"]["id"] for inv, _ in pairs(history) if inv["value"].get("poison")}
    halves = {inv["value"]["id"] for inv, _ in pairs(history) if inv["value"].get("half")}
    rolled = {inv["value"]["id"] for inv, _ in pairs(history) if rolled_back(inv["value"])}
    delivered = dequeued | {op["value"].get("id") for op in history  # poison ones too
                            if op["f"] in ("reject", "dead")}
    rolled_back_delivered = sorted(rolled & delivered)
    lost = sorted(acknowledged - dequeued - dead - rolled)
    unexpected = sorted((dequeued - attempted) | (dequeued & failed) | (dead - attempted)
                        | (dead & failed))
    duplicated = sorted(i for i, n in deliveries.items() if n > 1)
    extra = sum(n - 1 for n in deliveries.values())
    copies: dict = defaultdict(set)  # value id -> the message ids it was delivered under
    for op in history:
        if op["f"] == "dequeue" and op["type"] == "ok" and op["value"].get("msg_id"):
            copies[op["value"].get("id")].add(op["value"]["msg_id"])
    stored_twice = sorted(i for i, ids in copies.items() if len(ids) > 1)
    named_twice = [i for i in stored_twice if i in named]
    return {
        "valid": not lost and not unexpected and not named_twice and not rolled_back_delivered,
        "attempted": len(attempted), "acknowledged": len(acknowledged),
        "failed": len(failed), "indeterminate": len(indeterminate),
        "dequeued": len(dequeued), "deliveries": sum(deliveries.values()),
        "lost": len(lost), "lost_ids": lost[:50],
        "unexpected": len(unexpected), "unexpected_ids": [str(i) for i in unexpected[:50]],
        "duplicated": len(duplicated), "duplicate_deliveries": extra,
        "duplicate_rate": round(extra / len(dequeued), 6) if dequeued else 0.0,
        "recovered": len(dequeued & indeterminate),
        "stored_twice": len(stored_twice), "named_stored_twice": len(named_twice),
        "named_stored_twice_ids": named_twice[:50],
        "poison_acknowledged": len(poison & acknowledged), "dead": len(dead),
        "dead_twice": sum(1 for n in buried.values() if n > 1),
        "dead_not_poison": len(dead - poison),
        "halves": len(halves), "halves_acknowledged": len(halves & acknowledged),
        "rolled_back_delivered": len(rolled_back_delivered),
        "rolled_back_delivered_ids": rolled_back_delivered[:50],
        "check_backs": sum(1 for op in history if op["f"] == "check-back"),
    }


def order(history: list[dict], ordered: bool) -> dict:
    if not ordered:
        return {"valid": "skipped", "why": "the topic is not ordered (run with --ordered)"}
    seen: dict[str, set] = defaultdict(set)
    high: dict[str, int] = {}
    reorderings = []
    for op in history:
        if op["f"] != "dequeue" or op["type"] != "ok":
            continue
        v = op["value"]
        key, seq = v.get("key"), v.get("seq")
        if key is None or seq is None or seq in seen[key] or v.get("half"):
            continue
        seen[key].add(seq)
        if seq < high.get(key, -1):
            reorderings.append({"key": key, "seq": seq, "after": high[key],
                                "time": op["time"]})
        high[key] = max(high.get(key, -1), seq)
    return {"valid": not reorderings, "keys": len(seen), "reorderings": len(reorderings),
            "examples": reorderings[:20]}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def availability(history: list[dict]) -> dict:
    done = pairs(history)
    ok = [(inv, d) for inv, d in done if d and d["type"] == "ok"]
    lat = [d["time"] - inv["time"] for inv, d in ok]
    per_second: dict[int, Counter] = defaultdict(Counter)
    for inv, d in done:
        per_second[int(inv["time"])][d["type"] if d else "info"] += 1
    return {
        "valid": True,  # figures only: R=1 is unavailable while a leader is down
        "enqueues": len(done), "ok": len(ok),
        "success_rate": round(len(ok) / len(done), 4) if done else 0.0,
        "latency_ms": {q: round(1000 * v, 2) if v is not None else None for q, v in
                       (("p50", percentile(lat, .5)), ("p99", percentile(lat, .99)),
                        ("max", percentile(lat, 1.0)))},
        "per_second": {s: dict(c) for s, c in sorted(per_second.items())},
    }


def fault_windows(history: list[dict]) -> list[dict]:
    """[{start, end, kind, ...}] from the nemesis operations (end None: never healed)."""
    windows, current = [], None
    for op in history:
        if op["process"] != "nemesis":
            continue
        if op["f"] == "start":
            current = dict(op["value"] or {}, start=op["time"], end=None)
            windows.append(current)
        elif op["f"] in ("stop", "final-heal") and current is not None:
            current["end"] = op["time"]
            current = None
    return windows


def failover(history: list[dict]) -> dict:
    acked = sorted((inv["time"], d["time"], inv["value"]["partition"])
                   for inv, d in pairs(history)
                   if d and d["type"] == "ok" and inv["value"].get("partition") is not None)
    faults = []
    for w in fault_windows(history):
        times = {}
        for n in w.get("partitions", []):
            first = next((done for start, done, p in acked if p == n and start >= w["start"]),
                         None)
            times[n] = round(first - w["start"], 3) if first is not None else None
        if times:
            faults.append({"kind": w.get("kind"), "mode": w.get("mode"), "start": w["start"],
                           "end": w["end"], "partitions_s": times})
    worst = [max((t for t in f["partitions_s"].values() if t is not None), default=None)
             for f in faults]
    known = [t for t in worst if t is not None]
    return {"valid": True, "faults": faults,
            "max_s": max(known) if known else None,
            "median_s": percentile(known, .5),
            "never": sum(1 for t in worst if t is None)}


def liveness(found: dict | None) -> dict:
    """After the final heal every partition must take a write again (the runner waits for
    an acknowledged keyed publish of each, invoked after the heal, at most `bound_s`): a
    partition that never does is wedged, whatever else the run shows."""
    if found is None:
        return {"valid": "skipped", "why": "no final heal (an older history)"}
    return {"valid": not found["never"], **found}


def check(history: list[dict], ordered: bool, after_heal: dict | None = None) -> dict:
    results = {"total_queue": total_queue(history), "order": order(history, ordered),
               "availability": availability(history), "failover": failover(history),
               "liveness": liveness(after_heal)}
    results["valid"] = all(r["valid"] in (True, "skipped") for r in results.values())
    return results
