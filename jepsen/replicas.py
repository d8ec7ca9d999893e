"""The replica checker: after a run's final heal and drain, every node's copy of every
partition, read offline from its data folder and compared record by record.

`collect()` (while the cluster still runs): wait until every partition's ISR is full
again (bounded), note each partition's leader, epoch and ISR, stop the cluster cleanly
(SIGTERM: the nsqlookupds first, so no election runs while the nsqds stop, then every
nsqd at once; each drains, syncs and exits 0), then read each node's folder
`<data>/<topic>.topic/<partition>/` with the storage packages' codecs only
(diskqueue/record.py, commitlog/entry.py, the persisted committed end of
diskqueue/replicated.py): nothing is opened for writing, no recovery runs. jepsen never
imports the daemons (nsqd, nsqlookupd), only those plain codecs.

`check()` (after the history is read): per partition, against its leader's copy:
- every replica in the ISR holds the leader's records up to the leader's committed end,
  identical: offset, size, message id, body and the epoch of the commitlog entry that
  wrote it; a record it lacks there is `missing`, one that differs `divergent`;
- every replica (in the ISR or not) is a prefix of the leader's log up to its own end:
  a record at an offset where the leader has another record, or none (past the leader's
  end, or not on the leader's record boundaries), is `divergent`;
- every acknowledged enqueue is in some partition's committed log (`acknowledged_not_in_log`,
  skipped when retention dropped the head of a log), and a message id written twice is
  counted (`duplicated_in_log`: a publish retried after an unknown outcome, not a failure).
Divergent or missing records fail the run, even when no acknowledged message is lost.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field

from commitlog.entry import ENTRY_SIZE, CorruptEntryError, decode as decode_entry
from diskqueue.record import decode_all
from diskqueue.committed import decode_position


@dataclass
class Replica:
    """One node's copy of one partition, as its files hold it."""

    node: str
    path: str
    start_offset: int = 0
    end_offset: int = 0  # past the last whole record of the data
    committed: tuple[int, int] | None = None  # the persisted committed end
    fence: int = 0
    last_epoch: int = 0
    entries: int = 0
    # offset -> (size, msg_id, body, epoch of its commitlog entry; None: no entry covers it)
    records: dict[int, tuple] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _read_json(path: str, default):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def read_replica(node: str, path: str) -> Replica:
    """Read a partition folder without changing it."""
    r = Replica(node, path)
    meta = _read_json(os.path.join(path, "meta.json"), {})
    r.start_offset = int(meta.get("start_offset", 0))
    fence = _read_json(os.path.join(path, "fence.json"), {})
    r.fence = int(fence.get("epoch", 0)) if isinstance(fence, dict) else 0
    try:
        with open(os.path.join(path, "committed"), "rb") as f:
            r.committed = decode_position(f.read())
    except OSError:
        pass
    # the commitlog: (offset, end, epoch) per write request, in log id order
    spans = []
    clog = os.path.join(path, "commitlog")
    for name in sorted(os.listdir(clog)) if os.path.isdir(clog) else ():
        if not name.endswith(".clog"):
            continue
        with open(os.path.join(clog, name), "rb") as f:
            buf = f.read()
        for pos in range(0, len(buf) - ENTRY_SIZE + 1, ENTRY_SIZE):
            try:
                e = decode_entry(buf, pos)
            except CorruptEntryError as err:
                r.problems.append(f"commitlog {name}: {err}")
                break
            spans.append((e.offset, e.end_offset, e.epoch))
    r.entries = len(spans)
    r.last_epoch = spans[-1][2] if spans else 0
    # the data: every whole record of every segment
    records = []
    data = os.path.join(path, "data")
    for name in sorted(os.listdir(data)) if os.path.isdir(data) else ():
        if not name.endswith(".dat"):
            continue
        base = int(name[:-4])
        with open(os.path.join(data, name), "rb") as f:
            buf = f.read()
        recs, stop, error = decode_all(buf, 0, len(buf), base, 1 << 62)
        records += recs
        if error is not None:
            r.problems.append(f"segment {name}: {error}")
        elif stop != len(buf):
            r.problems.append(f"segment {name}: {len(buf) - stop} bytes of a torn record")
    i = 0
    for rec in records:
        while i < len(spans) and spans[i][1] <= rec.offset:
            i += 1
        epoch = spans[i][2] if i < len(spans) and spans[i][0] <= rec.offset else None
        r.records[rec.offset] = (rec.size, rec.msg_id, bytes(rec.body), epoch)
    if records:
        r.end_offset = records[-1].offset + records[-1].size
        r.start_offset = min(r.start_offset, records[0].offset) if r.start_offset else \
            records[0].offset
    return r


# ---- collecting, while the cluster runs ----------------------------------------------


def wait_isr_full(cluster, topic: str, partitions: int, replicas: int,
                  bound_s: float = 60.0) -> tuple[dict[int, dict], float | None]:
    """Poll the leaders' /stats until every partition's ISR has `replicas` members (or
    `bound_s`); returns the last states seen and the time it took (None: not within it)."""
    want = min(replicas, len(cluster.hosts))
    began = time.monotonic()
    states: dict[int, dict] = {}
    while True:
        states = cluster.partition_states(topic)
        if len(states) == partitions and all(len(s["isr"]) >= want for s in states.values()):
            return states, round(time.monotonic() - began, 2)
        if time.monotonic() - began > bound_s:
            return states, None
        time.sleep(0.5)


def stop_cleanly(cluster) -> dict[str, int | None]:
    """SIGTERM the nsqlookupds (no failover while the nsqds stop), then every nsqd at once;
    returns each nsqd's exit status (None: killed after 30 s, or it was not running)."""
    for h in cluster.hosts:
        d = h.daemons.get("nsqlookupd")
        if d is not None:
            d.stop(timeout=15)
    nsqds = [h.daemons["nsqd"] for h in cluster.hosts]
    for d in nsqds:
        if d.running:
            if d.paused:
                d.signal(signal.SIGCONT)
            d.proc.terminate()
    return {d.host.name: d.stop(timeout=30) for d in nsqds}


def collect(cluster, topic: str, partitions: int, replicas: int,
            bound_s: float = 60.0) -> dict:
    """Everything check() needs, read before the teardown removes the hosts' disks."""
    states, full_s = wait_isr_full(cluster, topic, partitions, replicas, bound_s)
    exits = stop_cleanly(cluster)
    copies: dict[int, dict[str, Replica]] = {}
    for h in cluster.hosts:
        folder = os.path.join(cluster.nsqd_data(h), f"{topic}.topic")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            if name.isdigit():
                copies.setdefault(int(name), {})[h.name] = read_replica(
                    h.name, os.path.join(folder, name))
    return {"states": states, "isr_full_s": full_s, "isr_bound_s": bound_s,
            "exits": exits, "copies": copies, "replicas": replicas,
            "want": min(replicas, len(cluster.hosts))}


# ---- checking ---------------------------------------------------------------------------


def _body_id(body: bytes) -> str | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value.get("id") if isinstance(value, dict) else None


def _leader_of(n: int, state: dict | None, copies: dict[str, Replica]) -> str:
    """The leader the cluster named at the end, else the copy with the highest epoch and
    the longest committed log."""
    if state and state.get("leader") in copies:
        return state["leader"]
    return max(copies, key=lambda k: (copies[k].last_epoch,
                                      (copies[k].committed or (0, 0))[0], k))


def check_partition(n: int, state: dict | None, copies: dict[str, Replica]) -> dict:
    leader = _leader_of(n, state, copies)
    lead = copies[leader]
    committed = lead.committed[0] if lead.committed else lead.start_offset
    if state and state.get("committed_offset") is not None:
        committed = max(committed, int(state["committed_offset"]))
    committed = min(committed, lead.end_offset)
    isr = list(state["isr"]) if state else []
    out = {"leader": leader, "epoch": state.get("epoch") if state else None, "isr": isr,
           "committed_offset": committed, "leader_records": len(lead.records),
           "unindexed": sum(1 for v in lead.records.values() if v[3] is None),
           "replicas": {}, "divergent": 0, "missing": 0, "examples": [],
           "problems": {k: c.problems for k, c in copies.items() if c.problems}}
    for name, copy in sorted(copies.items()):
        if name == leader:
            continue
        lo = max(lead.start_offset, copy.start_offset)
        divergent, beyond, examples = 0, 0, []
        for offset in sorted(copy.records):
            if offset < lo:
                continue
            mine, theirs = copy.records[offset], lead.records.get(offset)
            if mine == theirs:
                continue
            divergent += 1
            beyond += offset >= lead.end_offset
            if len(examples) < 5:
                examples.append({"replica": name, "offset": offset,
                                 "replica_record": _describe(mine),
                                 "leader_record": _describe(theirs)})
        missing = 0
        in_isr = name in isr
        if in_isr:
            missing = sum(1 for offset in lead.records
                          if lo <= offset < committed and offset not in copy.records)
        out["replicas"][name] = {"in_isr": in_isr, "records": len(copy.records),
                                 "end_offset": copy.end_offset, "last_epoch": copy.last_epoch,
                                 "committed": copy.committed[0] if copy.committed else None,
                                 "divergent": divergent, "beyond_leader_end": beyond,
                                 "missing": missing}
        out["divergent"] += divergent
        out["missing"] += missing
        out["examples"] += examples
    return out


def _describe(rec: tuple | None) -> dict | None:
    if rec is None:
        return None
    size, msg_id, body, epoch = rec
    return {"size": size, "msg_id": msg_id, "epoch": epoch, "id": _body_id(body),
            "body": body[:80].decode(errors="replace")}


def check(collected: dict | None, acknowledged: set[str]) -> dict:
    """The figures and the verdict (see the module's docstring)."""
    if not collected:
        return {"valid": "skipped", "why": "R=1: one copy of each partition"}
    copies, states = collected["copies"], collected["states"]
    parts = {n: check_partition(n, states.get(n), c) for n, c in sorted(copies.items()) if c}
    in_log: dict[str, int] = {}
    retained = True
    for n, p in parts.items():
        lead = copies[n][p["leader"]]
        retained &= lead.start_offset == 0
        for offset, rec in lead.records.items():
            if offset < p["committed_offset"]:
                vid = _body_id(rec[2])
                if vid is not None:
                    in_log[vid] = in_log.get(vid, 0) + 1
    not_in_log = sorted(acknowledged - set(in_log)) if retained else []
    divergent = sum(p["divergent"] for p in parts.values())
    missing = sum(p["missing"] for p in parts.values())
    return {
        "valid": divergent == 0 and missing == 0 and not not_in_log,
        "partitions_checked": len(parts),
        "records_compared": sum(r["records"] for p in parts.values()
                                for r in p["replicas"].values()),
        "divergent": divergent, "missing": missing,
        "acknowledged_not_in_log": len(not_in_log) if retained else "skipped (retention)",
        "acknowledged_not_in_log_ids": not_in_log[:50],
        "duplicated_in_log": sum(1 for c in in_log.values() if c > 1),
        "isr_full_s": collected["isr_full_s"],
        "isr_not_full": sorted(n for n, s in states.items() if len(s["isr"]) < collected["want"]),
        "unled": sorted(set(copies) - set(states)),
        "nsqd_exits": collected["exits"],
        "partitions": parts,
    }
