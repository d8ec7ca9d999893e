"""Actions: nsqadmin changes nothing itself, it asks the nodes' own HTTP actions.

Who is asked, by mode (the Snapshot's):
- cluster: what is cluster-wide goes to the master nsqlookupd (topic create/delete,
  channel create/delete, setoffset: it fans out to every partition's leader); what each
  node keeps (empty, pause, unpause) goes to every nsqd holding the topic; the trace
  switch to one nsqd (it is written to etcd, which every leader follows);
- classic (lookupd without etcd): as Go nsqadmin, create and delete go to every lookupd
  and, for deletes and channels, to every nsqd holding the topic; the rest to every nsqd
  holding it; tombstone to every lookupd;
- nsqd: every configured nsqd.
A channel's dead letters (max_attempts, requeue, purge: one by its id, or all) go to every
nsqd holding the topic, in every mode: each changes those of the partitions it leads.
A half message's decision (commit, rollback) goes to the node(s) leading the partition its
id names, in every mode (in the classic modes each nsqd leads a partition 0 of its own:
those that do not have the half answer 404).
Cluster mode only, to the master: a partition's leader moved within its ISR, a node drained
(or its drain cancelled), one balancer move now.
A fan-out succeeds when at least one node did and none failed other than by not having
the topic or channel (404: a node that holds none of its partitions). After an action the
Source reads the cluster again until the effect shows (a cluster-wide write reaches the
nodes through their etcd watch) or SETTLE_S passed, so the next page shows it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from nsqwire.ids import decode_msg_id, msg_id_partition
from nsqwire.protocol import valid_channel_name, valid_topic_name

from .times import BadTime, parse_time

TOPIC_ACTIONS = ("create", "delete", "empty", "pause", "unpause", "trace_on", "trace_off",
                 "tombstone", "move_leader", "half_commit", "half_rollback")
NODE_ACTIONS = ("drain", "drain_cancel")
CHANNEL_ACTIONS = ("create", "delete", "empty", "pause", "unpause", "setoffset", "trace_on",
                   "trace_off", "max_attempts", "dead_requeue", "dead_purge")
MAX_ATTEMPTS = 0xFFFF  # nsqd's limit: a message's attempts field is 16 bits
SETTLE_S = 5.0


class ActionError(Exception):
    """Refused before any node was asked: status, code, detail."""

    def __init__(self, status: int, code: str, detail: str = ""):
        super().__init__(code)
        self.status, self.code, self.detail = status, code, detail


@dataclass
class Outcome:
    action: str
    calls: list[dict] = field(default_factory=list)  # {node, path, status, answer}

    @property
    def ok(self) -> bool:
        good = [c for c in self.calls if c["status"] == 200]
        bad = [c for c in self.calls if c["status"] not in (200, 404)]
        return bool(good) and not bad

    def as_dict(self) -> dict:
        return {"ok": self.ok, "action": self.action, "calls": self.calls}

    def summary(self) -> str:
        parts = [f"{c['node']} {c['status'] or 'no answer'}"
                 + (f" {c['answer']}" if c["status"] != 200 and c["answer"] else "")
                 for c in self.calls]
        return f"{self.action}: {'done' if self.ok else 'FAILED'} ({'; '.join(parts)})"


def check_topic(name: str) -> None:
    if not name or not valid_topic_name(name):
        raise ActionError(400, "INVALID_TOPIC", f"not a valid topic name: {name!r}")


def check_channel(name: str) -> None:
    if not name or not valid_channel_name(name):
        raise ActionError(400, "INVALID_CHANNEL", f"not a valid channel name: {name!r}")


async def _calls(source, outcome: Outcome, targets: list[str], path: str, params: dict,
                 body: bytes | None = None) -> None:
    answers = await asyncio.gather(*(source.call("POST", t, path, params, body)
                                     for t in targets))
    for t, (status, answer) in zip(targets, answers):
        _record(outcome, t, path, status, answer)


def _record(out: Outcome, node: str, path: str, status: int, answer) -> None:
    if isinstance(answer, dict):
        answer = answer.get("message") or answer
    out.calls.append({"node": node, "path": path, "status": status,
                      "answer": answer if status != 200 else ""})


async def _snapshot(source):
    """The view an action acts on: the last poll's, read again when no lookupd answered it
    (its mode and nodes are then unknown: an nsqadmin just started on a loaded machine)."""
    snap = source.snapshot
    if snap.lookupds and all(lk["error"] for lk in snap.lookupds):
        snap = await source.refresh()
    return snap


async def _master(source, out: Outcome, path: str, params: dict,
                  body: bytes | None = None) -> None:
    """A cluster-wide write to the master lookupd. A lookupd that answers 503 NOT_MASTER
    names the master, which is asked instead; a 503 CLUSTER_METADATA_UNAVAILABLE (etcd
    away, or the lookupd's watch reopening: nothing written) is asked again, every 0.3 s
    for up to SETTLE_S, as a client retries a 503. These writes are idempotent."""
    target = source.snapshot.master_lookupd()
    deadline = time.monotonic() + SETTLE_S
    while True:
        status, answer = await source.call("POST", target, path, params, body)
        code = answer.get("message") if isinstance(answer, dict) else None
        if status == 503 and code == "NOT_MASTER" and answer.get("master_http_address"):
            target = answer["master_http_address"]
        elif not (status == 503 and code == "CLUSTER_METADATA_UNAVAILABLE"):
            break
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    _record(out, target, path, status, answer)


def _holders(snap, topic: str) -> list[str]:
    t = snap.topics.get(topic)
    nodes = [n for n in (t.nodes if t else ()) if not snap.nodes[n].error]
    return nodes


def _int_arg(form: dict, name: str, lo: int, hi: int) -> str | None:
    v = str(form.get(name) or "").strip()
    if not v:
        return None
    if not v.isdigit() or not lo <= int(v) <= hi:
        raise ActionError(400, f"INVALID_{name.upper()}", f"{name} must be {lo}..{hi}")
    return v


def _dead_id(form: dict) -> dict:
    """{"id": the dead letter's id} when the form names one (16 hex characters), else {}."""
    v = str(form.get("id") or "").strip().lower()
    if not v:
        return {}
    try:
        decode_msg_id(v.encode())
    except ValueError:
        raise ActionError(400, "INVALID_ID", f"not a dead letter's id: {v!r} (16 hex "
                                             "characters)") from None
    return {"id": v}


async def topic_action(source, action: str, topic: str, form: dict) -> Outcome:
    check_topic(topic)
    if action not in TOPIC_ACTIONS:
        raise ActionError(404, "UNKNOWN_ACTION", f"topic actions: {', '.join(TOPIC_ACTIONS)}")
    snap = await _snapshot(source)
    mode, out, q = snap.mode, Outcome(action=f"topic {action} {topic}"), {"topic": topic}
    lookupds = [lk["address"] for lk in snap.lookupds]
    if action != "create" and not action.startswith("trace") and topic not in snap.topics:
        raise ActionError(404, "TOPIC_NOT_FOUND", f"no topic {topic!r}")
    if action == "create":
        partitions = _int_arg(form, "partitions", 1, 1024)
        replicas = _int_arg(form, "replicas", 1, 5)
        if mode == "cluster":
            q |= {k: v for k, v in (("partition_num", partitions), ("replicator", replicas)) if v}
            await _master(source, out, "/topic/create", q)
        elif mode == "classic":
            await _calls(source, out, lookupds, "/topic/create", q)
        else:
            q |= {"partition_num": partitions} if partitions else {}
            await _calls(source, out, list(source.options.nsqd_http_address), "/topic/create", q)
    elif action == "delete":
        if mode == "cluster":
            await _master(source, out, "/topic/delete", q)
        else:
            await _calls(source, out, lookupds + _holders(snap, topic), "/topic/delete", q)
    elif action in ("empty", "pause", "unpause"):
        await _calls(source, out, _holders(snap, topic), f"/topic/{action}", q)
    elif action in ("trace_on", "trace_off"):
        await _trace(source, out, action, q)
    elif action == "tombstone":
        if mode != "classic":
            raise ActionError(400, "TOMBSTONE_NOT_SUPPORTED",
                              "tombstones are a classic nsqlookupd's: in cluster mode a node "
                              "leaves by its lease" if mode == "cluster" else
                              "tombstones need an nsqlookupd (--lookupd-http-address)")
        node = str(form.get("node") or "")
        if node not in snap.nodes:
            raise ActionError(400, "INVALID_NODE", f"no node {node!r} (give its HTTP address)")
        await _calls(source, out, lookupds, "/topic/tombstone", q | {"node": node})
    elif action == "move_leader":
        return await _move_leader(source, out, topic, form)
    elif action in ("half_commit", "half_rollback"):
        return await _half_decide(source, out, snap.topics[topic], action, form)
    shows = {"create": lambda t: t is not None and bool(t.partitions),
             "delete": lambda t: t is None, "pause": lambda t: t and t.paused,
             "unpause": lambda t: t and not t.paused, "trace_on": lambda t: t and t.traced,
             "trace_off": lambda t: t and not t.traced}.get(action)
    await _settle(source, out, shows and (lambda snap: shows(snap.topics.get(topic))))
    return out


def _cluster_only(snap, what: str) -> None:
    if snap.mode != "cluster":
        raise ActionError(400, "NOT_A_CLUSTER", f"{what} needs a cluster (nsqlookupd with "
                                                "--etcd-endpoints): nothing to move between")


async def _move_leader(source, out: Outcome, topic: str, form: dict) -> Outcome:
    """Move a partition's leader to another member of its ISR (the master's
    /partition/move_leader: no data copied, the epoch raised)."""
    snap = await _snapshot(source)
    _cluster_only(snap, "moving a leader")
    number = _int_arg(form, "partition", 0, 1023)
    to = str(form.get("to") or "")
    if number is None or not to:
        raise ActionError(400, "MISSING_ARG", "move_leader needs partition and to (a node id)")
    await _master(source, out, "/partition/move_leader",
                  {"topic": topic, "partition": number, "to": to})

    def moved(snap) -> bool:
        t = snap.topics.get(topic)
        return any(p.number == int(number) and p.leader_id == to for p in (t.partitions
                                                                          if t else ()))
    await _settle(source, out, moved)
    return out


def _half_id(form: dict) -> str:
    """The half message's id the form names (16 hex characters, lowercased)."""
    v = str(form.get("id") or "").strip().lower()
    if not v:
        raise ActionError(400, "MISSING_ARG", "half_commit and half_rollback need id")
    try:
        decode_msg_id(v.encode())
    except ValueError:
        raise ActionError(400, "INVALID_ID", f"not a half message's id: {v!r} (16 hex "
                                             "characters)") from None
    return v


async def _half_decide(source, out: Outcome, t, action: str, form: dict) -> Outcome:
    """Commit or roll back one half message at the leaders of the partition its id names
    (nsqd's /half/commit, /half/rollback: a decision sent again is answered the same)."""
    half_id = _half_id(form)
    number = msg_id_partition(int(half_id, 16))
    leaders = sorted({p.leader for p in t.partitions if p.number == number and p.leader})
    if not leaders:
        raise ActionError(404, "PARTITION_NOT_FOUND", f"no node leads partition {number} "
                                                      f"of {t.name!r} (the last poll)")
    path = "/half/commit" if action == "half_commit" else "/half/rollback"
    out.action += f" {half_id}"
    await _calls(source, out, leaders, path, {"topic": t.name, "id": half_id})
    await _settle(source, out, None)
    return out


async def node_action(source, action: str, http: str, form: dict) -> Outcome:
    """Drain a node (the master moves every partition off it, then marks it removable), or
    cancel that."""
    if action not in NODE_ACTIONS:
        raise ActionError(404, "UNKNOWN_ACTION", f"node actions: {', '.join(NODE_ACTIONS)}")
    snap = await _snapshot(source)
    _cluster_only(snap, "draining a node")
    node = snap.nodes.get(http)
    if node is None or not node.node_id:
        raise ActionError(404, "NODE_NOT_FOUND", f"no cluster node {http!r}")
    out = Outcome(action=f"node {action} {http}")
    q = {"node": node.node_id} | ({"cancel": "true"} if action == "drain_cancel" else {})
    await _master(source, out, "/node/drain", q)
    await _settle(source, out, None)
    return out


async def balance_now(source) -> Outcome:
    """One balancer move now (the master's /cluster/balance: refused outside its window)."""
    snap = await _snapshot(source)
    _cluster_only(snap, "balancing")
    out = Outcome(action="balance")
    await _master(source, out, "/cluster/balance", {})
    await _settle(source, out, None)
    return out


async def _settle(source, out: Outcome, shows) -> None:
    """Read the cluster again, until `shows(snapshot)` (when given and the action was done)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        snap = await source.refresh()
        if not out.ok or shows is None or shows(snap) or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.1)


async def _trace(source, out: Outcome, action: str, q: dict) -> None:
    snap = await _snapshot(source)
    path = "/message/trace/enable" if action == "trace_on" else "/message/trace/disable"
    live = [n.http for n in snap.nodes.values() if not n.error]
    if not live:
        raise ActionError(503, "NO_NODE_ANSWERED", "no nsqd answered the last poll")
    await _calls(source, out, live[:1] if snap.mode == "cluster" else live, path, q)


async def channel_action(source, action: str, topic: str, channel: str, form: dict) -> Outcome:
    check_topic(topic)
    check_channel(channel)
    if action not in CHANNEL_ACTIONS:
        raise ActionError(404, "UNKNOWN_ACTION",
                          f"channel actions: {', '.join(CHANNEL_ACTIONS)}")
    snap = await _snapshot(source)
    t = snap.topics.get(topic)
    if t is None:
        raise ActionError(404, "TOPIC_NOT_FOUND", f"no topic {topic!r}")
    if action != "create" and channel not in t.channels:
        raise ActionError(404, "CHANNEL_NOT_FOUND", f"no channel {channel!r} in {topic!r}")
    mode, q = snap.mode, {"topic": topic, "channel": channel}
    out = Outcome(action=f"channel {action} {topic}/{channel}")
    lookupds = [lk["address"] for lk in snap.lookupds]
    holders = _holders(snap, topic)
    if action in ("create", "delete"):
        if mode == "cluster":
            await _master(source, out, f"/channel/{action}", q)
        else:
            await _calls(source, out, lookupds + holders, f"/channel/{action}", q)
    elif action in ("empty", "pause", "unpause"):
        await _calls(source, out, holders, f"/channel/{action}", q)
    elif action == "setoffset":
        text = str(form.get("time") or "")
        try:
            when = parse_time(text, time.time(), "replay time")
        except BadTime as e:
            raise ActionError(400, "INVALID_TIME", str(e)) from None
        body = f"timestamp:{int(when)}".encode()
        if mode == "cluster":
            await _master(source, out, "/channel/setoffset", q, body)
        else:
            await _calls(source, out, holders, "/channel/setoffset", q, body)
    elif action == "max_attempts":
        n = _int_arg(form, "max_attempts", 0, MAX_ATTEMPTS)
        if n is None:
            raise ActionError(400, "MISSING_ARG", "max_attempts needs max_attempts "
                                                  f"(0..{MAX_ATTEMPTS}; 0: never bury)")
        await _calls(source, out, holders, "/channel/config", q | {"max_attempts": n})
    elif action in ("dead_requeue", "dead_purge"):
        path = "/channel/dead/requeue" if action == "dead_requeue" else "/channel/dead/purge"
        await _calls(source, out, holders, path, q | _dead_id(form))
    else:
        await _trace(source, out, action, q)
    shows = {"create": lambda c: c is not None, "delete": lambda c: c is None,
             "pause": lambda c: c and c.paused, "unpause": lambda c: c and not c.paused,
             "trace_on": lambda c: c and c.traced,
             "trace_off": lambda c: c and not c.traced}.get(action)

    def channel_of(snap):
        t = snap.topics.get(topic)
        return t.channels.get(channel) if t else None
    await _settle(source, out, shows and (lambda snap: shows(channel_of(snap))))
    return out
