"""Stats: the node's numbers in the shape of classic nsqd's /stats, built by pure functions.

`topic_entries(nsqd, ...)` makes each topic's entry and `node_stats(nsqd, entries, ...)`
the document around them, reading the node's objects (topics, partitions, channels,
clients, the diskqueue counters) without I/O and without awaiting: each topic's entry is
one consistent snapshot, and the HTTP edge lets the loop run between two (nsqd/pace.py:
at 10,000 partitions the walk is hundreds of milliseconds); `render_text` prints the
document like nsqd v1.3.0's text format. /stats serves both, /metrics (metrics.py)
renders the same dict for Prometheus.

Classic fields keep their names, order and meaning so nsq_stat and nsqadmin read
them; ours are additive:
- top level: `client_count` (TCP connections), `data_free_bytes` (free on the data
  path's file system; under 1 MiB the node's health says the disk is full), `journal`
  (unless `--journal false`: syncs (one a round), alone (batches that synced their own segment
  instead: written while no other partition wrote, or a round's one record), records,
  bytes, checkpoints, sync_seconds_total, failed;
  diskqueue/journal.py), `file_budget` (logs that may hold their files open at once:
  limit, held, waiting for a place, waits since start; diskqueue/budget.py);
- topic: `partition_num` and `ordered` (its Assignment, nsqd/assignment.py);
  `partitions`, one entry per partition number 0..partition_num-1 and any other held
  here, each with `leader` (this node leads it) and `channels` (the names it has here):
  a partition not led here has only `partition`, `leader` (false), `depth` (0),
  `channels` ([]) and `error` (null); a led one [{partition, leader, channels, depth,
  start_offset, start_count, committed_offset,
  committed_count, written_offset, written_count, group_commit{batches, syncs,
  batch_messages_total, sync_seconds_total, batch_messages_histogram,
  sync_seconds_histogram}, producers (idempotent producers it knows: producers.py),
  producer_duplicates (their requests answered again, not written), half_waiting (half
  messages waiting for their decision: halves.py), half_committed, half_rolled_back,
  half_checks (check-backs made), half_expired (rolled back after their last check-back):
  since the partition opened here, error}]: `error` is
  null while the partition serves, else why
  it does not (its log failed); a partition that failed to open has only `partition`,
  `depth` (0) and `error`;
- channel: `partitions` [{partition, depth, backend_depth, in_flight_count,
  deferred_count, requeued_count, message_count, requeue_count, timeout_count,
  finish_count, filtered_count (auto-finished by an ext_filter), max_attempts, dead_count
  (dead letters kept), buried_count (messages buried since the channel opened here:
  deadletters.py), client_count, paused,
  ordered, confirmed, confirmed_count, next_read, next_count, window, error}].

What the classic numbers mean here (channels are cursors over the partition's log):
- topic `depth`: messages held for channels that do not exist yet (classic: the
  topic's own queue, which its pump empties into the channels). A topic with
  channels has none: every message is in its channels at once. `backend_depth`
  equals `depth`: everything is on disk.
- channel `depth`: messages not yet delivered (unread in the log plus requeued);
  `backend_depth`: the unread part, still on disk only.
- channel `deferred_count`: messages waiting for their due time (DPUB, REQ with a
  delay), in memory or in the disk delay queue. As in classic nsqd a DPUB counts
  there from its publish, also in a channel no client reads: the channel takes the
  DPUBs at the head of its unread log without a client (Channel._hold_deferred_ahead).
  One behind a message still unread counts in `depth` until that message is read,
  and a paused channel takes none ahead.
- channel `message_count`: messages that reached the channel since this process
  opened it (committed count minus the count it was opened at); `requeue_count`,
  `timeout_count`: since start, as classic.
- `e2e_processing_latency` is always `{"count": 0, "percentiles": null}` (the
  classic e2e percentile option is not implemented).
- Lists are `[]`, never `null`, where Go's nil slices would print `null` (an
  unknown `topic=` filter, `include_clients=false`, no producers).
- `memory`: same keys as Go's runtime stats, from Python's: `heap_objects` are the
  memory blocks the allocator holds (`sys.getallocatedblocks`; never `gc.get_objects()`,
  whose list of every object, taken while a worker thread is building a tuple, makes
  that thread fail with SystemError), `heap_in_use_bytes` the resident set size,
  `gc_pause_usec_*` percentiles of the last 256 collections (timed by a gc callback
  installed with `install_gc_timer`), `gc_total_runs` collections of every
  generation; `heap_idle_bytes`, `heap_released_bytes`, `next_gc_bytes` are 0.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from collections import deque
from datetime import datetime, timezone

from diskqueue.queue import BATCH_MESSAGES_BUCKETS, SYNC_SECONDS_BUCKETS


E2E_NONE = {"count": 0, "percentiles": None}
# Classic client states (clientV2): init 0, disconnected 1, connected 2, subscribed 3, closing 4.
_STATE_INIT, _STATE_SUBSCRIBED, _STATE_CLOSING = 0, 3, 4


# ---- node ------------------------------------------------------------------


def topic_entries(nsqd, conns: dict, topic: str = "", channel: str = "",
                  include_clients: bool = True):
    """Each topic's /stats entry, one at a time, in name order; `topic`/`channel` filter as
    classic nsqd does ("" = all). Between two entries the loop may run (nsqd/pace.py): a
    topic deleted meanwhile is left out."""
    for name in ([topic] if topic else sorted(nsqd.topics)):
        t = nsqd.topics.get(name)
        if t is not None:
            entry = topic_stats(t, channel, include_clients, conns)
            if entry is not None:
                yield entry


def node_stats(nsqd, topics: list[dict], conns: dict, topic: str = "",
               include_clients: bool = True, include_mem: bool = True) -> dict:
    """The /stats JSON document around `topics` (topic_entries' for the same `conns` and
    `topic` filter)."""
    out = {"version": nsqd.version, "health": nsqd.health, "start_time": int(nsqd.start_time),
           "topics": topics}
    if include_mem:
        out["memory"] = memory_stats()
    out["producers"] = producer_stats(conns, topic) if include_clients else []
    out["client_count"] = len(conns)
    out["data_free_bytes"] = nsqd.disk.free
    out["lookupd"] = nsqd.lookup.state()  # ours: each nsqlookupd peer (lookup.py)
    out["trace"] = nsqd.tracer.state()  # ours: message trace (tracing.py)
    if nsqd.journal is not None:  # ours: the node journal (diskqueue/journal.py)
        out["journal"] = {**nsqd.journal.stats, "failed": nsqd.journal.failed is not None}
    out["file_budget"] = nsqd.open_logs.files.stats()  # ours: logs with files open (openlogs.py)
    if nsqd.cluster is not None:  # ours: cluster mode (cluster.py)
        out["cluster"] = nsqd.cluster.state()
    return out


def connections(nsqd) -> dict:
    """Client -> its connection (for the protocol state and TLS details)."""
    out = {}
    for conn in list(nsqd.connections):
        client = getattr(conn, "client", None)
        if client is not None:
            out[client] = conn
    return out


# ---- topics and partitions ---------------------------------------------------


def topic_stats(topic, channel_filter: str, include_clients: bool, conns: dict) -> dict | None:
    """One topic entry, or None when `channel_filter` names a channel the topic lacks."""
    by_name: dict[str, list] = {}
    for p in topic.partitions.values():
        for name, c in p.channels.items():
            by_name.setdefault(name, []).append(c)
    if channel_filter:
        if channel_filter not in by_name:
            return None
        by_name = {channel_filter: by_name[channel_filter]}
    a = topic.assignment
    numbers = sorted({*range(a.partition_num), *topic.partitions, *topic.failed})
    partitions = [partition_stats(topic.partitions[n]) if n in topic.partitions
                  else {"partition": n, "leader": n in a.leading, "depth": 0, "channels": [],
                        "error": topic.failed.get(n)}
                  for n in numbers]
    depth = sum(p["depth"] for p in partitions)
    return {
        "topic_name": topic.name,
        "channels": [channel_stats(name, by_name[name], include_clients, conns)
                     for name in sorted(by_name)],
        "depth": depth,
        "backend_depth": depth,
        "message_count": topic.message_count,
        "message_bytes": topic.message_bytes,
        "paused": topic.paused,
        "e2e_processing_latency": dict(E2E_NONE),
        "partition_num": a.partition_num,
        "ordered": a.ordered,
        "partitions": partitions,
    }


def partition_depth(partition) -> int:
    """Classic topic depth of one partition: what waits for a first channel."""
    return 0 if partition.channels else max(0, partition.depth())


def partition_stats(partition) -> dict:
    q = partition.queue
    s = q.stats
    h = getattr(q, "histograms", None) or {}
    return {
        "partition": partition.number,
        "leader": partition.number in partition.topic.assignment.leading,
        "channels": sorted(partition.channels),
        "depth": partition_depth(partition),
        "start_offset": q.start_offset,
        "start_count": q.start_count,
        "committed_offset": q.committed_end,
        "committed_count": q.committed_count,
        "written_offset": q.written_end,
        "written_count": q.written_count,
        "sync_every": q.options.sync.every_messages,
        "sync_timeout_ms": q.options.sync.every_ms,
        "group_commit": {
            "batches": s["batches"],
            "syncs": s["syncs"],
            "batch_messages_total": s["batch_messages_total"],
            "sync_seconds_total": s["sync_seconds_total"],
            "batch_messages_histogram": _histogram(BATCH_MESSAGES_BUCKETS,
                                                   h.get("batch_messages")),
            "sync_seconds_histogram": _histogram(SYNC_SECONDS_BUCKETS, h.get("sync_seconds")),
        },
        "producers": len(partition.producers) if partition.producers is not None else 0,
        "producer_duplicates": (partition.producers.duplicates
                                if partition.producers is not None else 0),
        **half_stats(partition.halves),
        "error": str(q.failed) if q.failed is not None else None,
    }


def half_stats(halves) -> dict:
    """A partition's half messages (halves.py): waiting now, and since it opened here."""
    return {"half_waiting": halves.table.waiting_count, "half_committed": halves.committed,
            "half_rolled_back": halves.rolled_back, "half_checks": halves.checks,
            "half_expired": halves.expired}


def _histogram(bounds, counts) -> dict:
    """{"le": upper bounds, "counts": per bucket, the last one above the last bound}."""
    return {"le": list(bounds), "counts": list(counts) if counts else [0] * (len(bounds) + 1)}


# ---- channels ----------------------------------------------------------------


def channel_stats(name: str, channels: list, include_clients: bool, conns: dict) -> dict:
    """One classic channel entry for a channel name, summed over its partitions."""
    parts = [channel_partition_stats(c) for c in sorted(channels, key=lambda c: c.partition)]
    clients = []
    if include_clients:
        seen = set()  # a client of several partitions is one client of the channel
        for c in channels:
            for client in c.clients:
                if client not in seen:
                    seen.add(client)
                    clients.append(client_stats(client, conns.get(client), ""))

    def total(key):
        return sum(p[key] for p in parts)

    return {
        "channel_name": name,
        "depth": total("depth"),
        "backend_depth": total("backend_depth"),
        "in_flight_count": total("in_flight_count"),
        "deferred_count": total("deferred_count"),
        "message_count": total("message_count"),
        "requeue_count": total("requeue_count"),
        "timeout_count": total("timeout_count"),
        "client_count": len({cl for c in channels for cl in c.clients}),
        "clients": clients,
        "paused": any(p["paused"] for p in parts),
        "e2e_processing_latency": dict(E2E_NONE),
        "partitions": parts,
    }


def channel_partition_stats(c) -> dict:
    q = c.queue
    cursor = c.cursor
    return {
        "partition": c.partition,
        "depth": max(0, c.depth),
        "backend_depth": max(0, c.backend_depth),
        "in_flight_count": c.in_flight_count,
        # classic meaning: messages waiting for a due time, here in memory or on disk
        "deferred_count": len(c.deferred) + (c.delay.waiting if c.delay is not None else 0),
        "delayed_count": c.delayed_count,  # ours: in the disk delay queue (waiting or taken)
        "delay_oldest_due_ms": c.delay.oldest_due_ms if c.delay is not None else None,
        "delay_error": c.delay.error if c.delay is not None else None,
        "requeued_count": len(c.requeued) + len(c.from_delay),
        "message_count": max(0, q.committed_count - getattr(c, "opened_count", 0)),
        "requeue_count": c.requeue_count,
        "timeout_count": c.timeout_count,
        "finish_count": c.finish_count,
        "filtered_count": c.filtered_count,  # ours: auto-finished by ext_filter (tags.py)
        # ours: dead letters (deadletters.py): the limit, kept now, buried since opened here
        "max_attempts": c.max_attempts,
        "dead_count": c.dead_count,
        "buried_count": c.dead.buried_count if c.dead is not None else 0,
        "client_count": len(c.clients),
        "paused": c.paused,
        "ordered": c.ordered is not None,  # ours: nsqd/ordered.py
        "confirmed": cursor.confirmed,
        "confirmed_count": cursor.confirmed_count,
        "next_read": cursor.next_read,
        "next_count": cursor.next_count,
        "window": cursor.window_size,
        "error": c.error,
    }


# ---- clients -----------------------------------------------------------------


def client_stats(client, conn, topic_filter: str) -> dict:
    """A classic ClientV2Stats entry (pub_counts only when there are some, as Go's omitempty)."""
    settings = client.settings
    state = _STATE_INIT
    if conn is not None:
        if conn.state == conn.SUBSCRIBED:
            state = _STATE_SUBSCRIBED
        elif conn.state == conn.CLOSING:
            state = _STATE_CLOSING
    out = {
        "client_id": settings.client_id,
        "hostname": settings.hostname,
        "version": "V2",
        "remote_address": client.remote_address,
        "state": state,
        "ready_count": client.ready_count,
        "in_flight_count": len(client.in_flight),
        "message_count": client.message_count,
        "finish_count": client.finish_count,
        "requeue_count": client.requeue_count,
        "connect_ts": int(client.connect_ts),
        "sample_rate": settings.sample_rate,
        "deflate": settings.deflate,
        "snappy": settings.snappy,
        "user_agent": settings.user_agent,
    }
    if settings.desired_tag:  # Youzan's client stats name these; only when set
        out["desired_tag"] = settings.desired_tag
    if settings.ext_filter is not None:
        out["ext_filter"] = settings.ext_filter.spec
    if client.authorizations is not None:
        out["authed"] = True
        if client.auth_identity:
            out["auth_identity"] = client.auth_identity
    pub_counts = [{"topic": t, "count": n} for t, n in sorted(client.pub_counts.items())
                  if not topic_filter or t == topic_filter]
    if pub_counts:
        out["pub_counts"] = pub_counts
    out.update(_tls_stats(client, conn))
    return out


def _tls_stats(client, conn) -> dict:
    cipher = version = protocol = ""
    if client.tls and conn is not None and conn.transport is not None:
        ssl_object = conn.transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            c = ssl_object.cipher()
            cipher = c[0] if c else ""
            version = (ssl_object.version() or "").replace("TLSv", "TLS")
            protocol = ssl_object.selected_alpn_protocol() or ""
    return {"tls": bool(client.tls), "tls_cipher_suite": cipher, "tls_version": version,
            "tls_negotiated_protocol": protocol,
            "tls_negotiated_protocol_is_mutual": bool(client.tls)}


def producer_stats(conns: dict, topic_filter: str) -> list[dict]:
    """Connections that published anything (classic: a client is a producer once it has)."""
    return [client_stats(client, conn, topic_filter)
            for client, conn in sorted(conns.items(), key=lambda kv: kv[0].id)
            if client.pub_counts]


# ---- memory ------------------------------------------------------------------

_gc_pauses: deque[float] = deque(maxlen=256)  # seconds, most recent collections
_gc_started = [0.0]


def _gc_callback(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
    elif _gc_started[0]:
        _gc_pauses.append(time.perf_counter() - _gc_started[0])


def install_gc_timer() -> None:
    """Time garbage collections for the gc_pause_usec_* percentiles (idempotent)."""
    if _gc_callback not in gc.callbacks:
        gc.callbacks.append(_gc_callback)


def _percentile_usec(values: list[float], q: float) -> int:
    if not values:
        return 0
    values = sorted(values)
    return int(values[min(len(values) - 1, int(q * len(values)))] * 1e6)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_stats() -> dict:
    pauses = list(_gc_pauses)
    return {
        "heap_objects": sys.getallocatedblocks(),
        "heap_idle_bytes": 0,
        "heap_in_use_bytes": _rss_bytes(),
        "heap_released_bytes": 0,
        "gc_pause_usec_100": _percentile_usec(pauses, 1.0),
        "gc_pause_usec_99": _percentile_usec(pauses, 0.99),
        "gc_pause_usec_95": _percentile_usec(pauses, 0.95),
        "next_gc_bytes": 0,
        "gc_total_runs": sum(s.get("collections", 0) for s in gc.get_stats()),
    }


# ---- text format -------------------------------------------------------------


def go_duration(ns: int) -> str:
    """A duration as Go's time.Duration.String() prints it ("23.114703482s", "1m5s", "2ms")."""
    if ns == 0:
        return "0s"
    sign, u = ("-", -ns) if ns < 0 else ("", ns)
    if u < 1000:
        return f"{sign}{u}ns"
    if u < 1_000_000:
        return f"{sign}{_fraction(u, 1000)}µs"
    if u < 1_000_000_000:
        return f"{sign}{_fraction(u, 1_000_000)}ms"
    hours, rem = divmod(u, 3600 * 10**9)
    minutes, rem = divmod(rem, 60 * 10**9)
    text = _fraction(rem, 10**9) + "s"
    if hours:
        text = f"{hours}h{minutes}m{text}"
    elif minutes:
        text = f"{minutes}m{text}"
    return sign + text


def _fraction(value: int, unit: int) -> str:
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    digits = str(frac).rjust(len(str(unit)) - 1, "0").rstrip("0")
    return f"{whole}.{digits}"


def _rfc3339(ts: float) -> str:
    dt = datetime.fromtimestamp(int(ts), timezone.utc).astimezone()
    text = dt.isoformat(timespec="seconds")
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def _client_line(c: dict, now: float) -> str:
    connected = go_duration(max(0, int(now) - c["connect_ts"]) * 10**9)
    port = c["remote_address"].rpartition(":")[2]
    ident = f"{c['hostname']}:{port} {c['user_agent']}"
    if c.get("pub_counts"):
        total = sum(p["count"] for p in c["pub_counts"])
        topics = ",".join(f"{p['topic']}={p['count']}" for p in c["pub_counts"])
        return (f"[{c['version']} {ident:<21}] msgs: {total:<8d} topics: {topics} "
                f"connected: {connected}")
    return (f"[{c['version']} {ident:<21}] state: {c['state']} inflt: {c['in_flight_count']:<4d} "
            f"rdy: {c['ready_count']:<4d} fin: {c['finish_count']:<8d} "
            f"re-q: {c['requeue_count']:<8d} msgs: {c['message_count']:<8d} "
            f"connected: {connected}")


def render_text(stats: dict, now: float | None = None) -> str:
    """The classic plain-text /stats (nsqd v1.3.0 printStats), from a node_stats dict."""
    now = time.time() if now is None else now
    start = stats["start_time"]
    lines = [f"nsqd v{stats['version']} (built w/python{platform.python_version()})",
             f"start_time {_rfc3339(start)}",
             f"uptime {go_duration(max(0, int((now - start) * 1e9)))}",
             "", f"Health: {stats['health']}"]
    out = "\n".join(lines) + "\n"
    mem = stats.get("memory")
    if mem is not None:
        out += "\nMemory:\n"
        for key in ("heap_objects", "heap_idle_bytes", "heap_in_use_bytes",
                    "heap_released_bytes", "gc_pause_usec_100", "gc_pause_usec_99",
                    "gc_pause_usec_95", "next_gc_bytes", "gc_total_runs"):
            out += f"   {key:<25}\t{mem[key]}\n"
    topics = stats["topics"]
    out += "\nTopics: None\n" if not topics else "\nTopics:"
    for t in topics:
        prefix = "*P " if t["paused"] else "   "
        out += (f"\n{prefix}[{t['topic_name']:<15}] depth: {t['depth']:<5d} "
                f"be-depth: {t['backend_depth']:<5d} msgs: {t['message_count']:<8d} e2e%: \n")
        for c in t["channels"]:
            prefix = "   *P " if c["paused"] else "      "
            out += (f"{prefix}[{c['channel_name']:<25}] depth: {c['depth']:<5d} "
                    f"be-depth: {c['backend_depth']:<5d} inflt: {c['in_flight_count']:<4d} "
                    f"def: {c['deferred_count']:<4d} re-q: {c['requeue_count']:<5d} "
                    f"timeout: {c['timeout_count']:<5d} msgs: {c['message_count']:<8d} e2e%: \n")
            for client in c["clients"] or []:
                out += f"        {_client_line(client, now)}\n"
    producers = stats["producers"]
    if not producers:
        out += "\nProducers: None\n"
    else:
        out += "\nProducers:\n"
        for client in producers:
            out += f"   {_client_line(client, now)}\n"
    return out
