"""Metrics: the /stats numbers in the Prometheus text exposition format (version 0.0.4).

A pure generator over a `stats.node_stats` dict, written by hand (no client library),
whose pieces joined in order are the exposition (the HTTP edge joins them with the loop's
turns between: pace.py): every family has its HELP and TYPE lines and all its samples
together; label
values are escaped; histograms have cumulative `_bucket{le=...}` samples ending
at `+Inf`, then `_sum` and `_count`.

Families (labels: topic, partition, channel):
- node: nsqd_info{version}, nsqd_up (1 when health is OK), nsqd_start_time_seconds,
  nsqd_clients (TCP connections), nsqd_producers, nsqd_topics, nsqd_data_free_bytes;
  nsqd_journal_syncs_total, _records_total, _bytes_total, _sync_seconds_total,
  _checkpoints_total and nsqd_journal_up (unless --journal false);
- topic: nsqd_topic_depth, nsqd_topic_paused, nsqd_topic_messages_total,
  nsqd_topic_message_bytes_total, nsqd_topic_partitions (its partition_num);
- partition: nsqd_partition_leader (1 for each partition this node leads, 0 for the
  topic's others), nsqd_partition_up (1 while it serves, 0 when it failed to open or its log
  failed; only partitions led or failed here; the others only for partitions that opened),
  nsqd_partition_depth,
  nsqd_partition_start_offset,
  nsqd_partition_committed_offset, nsqd_partition_committed_count,
  nsqd_partition_written_offset, nsqd_partition_producers,
  nsqd_partition_producer_duplicates_total (nsqd/producers.py), group commit histograms
  nsqd_group_commit_batch_messages (messages per written batch) and
  nsqd_group_commit_sync_seconds (time per sync);
- channel (per partition): nsqd_channel_depth, nsqd_channel_backend_depth,
  nsqd_channel_in_flight, nsqd_channel_deferred, nsqd_channel_requeued (waiting for
  redelivery now), nsqd_channel_clients, nsqd_channel_paused, nsqd_channel_window,
  nsqd_channel_confirmed_offset, nsqd_channel_delay_store_up (0 when its delay store
  failed: deferred messages wait in memory), and the counters nsqd_channel_messages_total,
  nsqd_channel_requeues_total, nsqd_channel_timeouts_total, nsqd_channel_finishes_total.
"""

from __future__ import annotations

import math

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PIECE_LINES = 2000  # lines a piece of render() holds at most


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        if math.isnan(value):
            return "NaN"
        return repr(value)
    return str(int(value))


def _labels(labels: dict) -> str:
    """The inside of a sample's braces: `k="v",...` ("" for no labels)."""
    return ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items())


def _lines(name: str, samples):
    """A family's sample lines; samples: (labels inside the braces, value)."""
    for labels, value in samples:
        yield f"{name}{{{labels}}} {_number(value)}" if labels else f"{name} {_number(value)}"


def _histogram_lines(name: str, samples):
    """samples: (labels inside the braces, bounds, per-bucket counts (+ overflow), sum)."""
    for labels, bounds, counts, total in samples:
        cumulative = 0
        sep = "," if labels else ""
        for bound, count in zip(list(bounds) + [math.inf], counts):
            cumulative += count
            le = "+Inf" if math.isinf(bound) else _number(bound)
            yield f'{name}_bucket{{{labels}{sep}le="{le}"}} {cumulative}'
        braces = f"{{{labels}}}" if labels else ""
        yield f"{name}_sum{braces} {_number(total)}"
        yield f"{name}_count{braces} {cumulative}"


def _pieces(head: str, lines):
    """`head` and the lines, as pieces of at most PIECE_LINES lines, each ending in a newline."""
    chunk = [head]
    for line in lines:
        chunk.append(line)
        if len(chunk) >= PIECE_LINES:
            yield "\n".join(chunk) + "\n"
            chunk = []
    if chunk:
        yield "\n".join(chunk) + "\n"


def family(name: str, kind: str, help_text: str, samples):
    """Pieces of one family: its HELP and TYPE lines, then all its samples."""
    head = f"# HELP {name} {help_text}\n# TYPE {name} {kind}"
    if kind == "histogram":
        return _pieces(head, _histogram_lines(name, samples))
    return _pieces(head, _lines(name, samples))


def render(stats: dict):
    """Prometheus text for a node_stats() dict (clients and memory may be left out of it),
    in pieces (a family, or PIECE_LINES lines of one) to be joined in order. Label texts
    are made once a topic, partition and channel, not once a sample."""
    topics = stats["topics"]
    held = [(t, p) for t in topics for p in t.get("partitions", [])
            if p.get("leader", True) or p.get("error")]  # served here, or failed here
    partitions = [(t, p) for t, p in held if "committed_offset" in p]  # opened
    channels = [(t, c, cp) for t in topics for c in t["channels"] for cp in c.get("partitions", [])]
    tl = {id(t): _labels({"topic": t["topic_name"]}) for t in topics}
    pl = {id(p): f'{tl[id(t)]},partition="{p["partition"]}"'
          for t in topics for p in t.get("partitions", [])}
    cl = {id(cp): f'{tl[id(t)]},partition="{cp["partition"]}",channel="'
                  f'{escape_label(c["channel_name"])}"' for t, c, cp in channels}

    yield from family("nsqd_info", "gauge", "Version of this nsqd.",
                      [(_labels({"version": stats["version"]}), 1)])
    yield from family("nsqd_up", "gauge", "1 when the node reports health OK.",
                      [("", stats["health"] == "OK")])
    yield from family("nsqd_start_time_seconds", "gauge",
                      "Start time of the process (unix seconds).", [("", stats["start_time"])])
    yield from family("nsqd_clients", "gauge", "TCP client connections.",
                      [("", stats.get("client_count", 0))])
    yield from family("nsqd_producers", "gauge", "TCP connections that have published.",
                      [("", len(stats.get("producers") or []))])
    yield from family("nsqd_topics", "gauge", "Topics on this node.", [("", len(topics))])
    if stats.get("data_free_bytes") is not None:
        yield from family("nsqd_data_free_bytes", "gauge",
                          "Bytes free on the file system of the data path.",
                          [("", stats["data_free_bytes"])])

    journal = stats.get("journal")
    if journal is not None:  # the node journal (diskqueue/journal.py)
        yield from family("nsqd_journal_syncs_total", "counter",
                          "Rounds of the node journal: one fdatasync for every partition's "
                          "batches.",
                          [("", journal["syncs"])])
        yield from family("nsqd_journal_records_total", "counter",
                          "Partition batches journaled.", [("", journal["records"])])
        yield from family("nsqd_journal_bytes_total", "counter",
                          "Bytes written to the node journal.", [("", journal["bytes"])])
        yield from family("nsqd_journal_sync_seconds_total", "counter",
                          "Time in the node journal's writes and syncs.",
                          [("", journal["sync_seconds_total"])])
        yield from family("nsqd_journal_checkpoints_total", "counter",
                          "Journal files retired once their segments were synced.",
                          [("", journal["checkpoints"])])
        yield from family("nsqd_journal_up", "gauge",
                          "0 once the node journal failed: each partition syncs its own segment "
                          "until the node restarts.",
                          [("", not journal["failed"])])

    trace = stats.get("trace")
    if trace is not None:  # message trace (tracing.py)
        yield from family("nsqd_trace_events_written_total", "counter",
                          "Trace events written to the trace store.", [("", trace["written"])])
        yield from family("nsqd_trace_events_dropped_total", "counter",
                          "Trace events dropped: the buffer was full, or the store refused them.",
                          [('reason="buffer_full"', trace["dropped_full"]),
                           ('reason="store_failed"', trace["dropped_failed"])])
        yield from family("nsqd_trace_events_buffered", "gauge",
                          "Trace events waiting for the store.", [("", trace["buffered"])])
        yield from family("nsqd_trace_sink", "gauge", "The trace store events go to (1).",
                          [(_labels({"sink": trace["sink"]}), 1)])
        yield from family("nsqd_trace_store_retries_total", "counter",
                          "Batches sent again because the trace store could not be reached.",
                          [("", trace["retries"])])

    cluster = stats.get("cluster")
    if cluster is not None:
        yield from family("nsqd_cluster_etcd_connected", "gauge",
                          "1 while the node's watch of etcd is connected.",
                          [("", cluster["etcd_connected"])])
        yield from family("nsqd_cluster_lease_ok", "gauge",
                          "1 while the node's registration lease is held in etcd.",
                          [("", cluster["lease_ok"])])
        yield from family("nsqd_cluster_partitions_led", "gauge",
                          "Partitions this node leads, as etcd assigns them.",
                          [("", cluster["partitions_led"])])
        yield from family("nsqd_cluster_forwarded_total", "counter",
                          "Publish requests this node forwarded to a leader, answered OK.",
                          [("", cluster["forwarded"])])
        yield from family("nsqd_cluster_forward_failed_total", "counter",
                          "Publish requests forwarded to a leader that failed or whose outcome is "
                          "unknown.", [("", cluster["forward_failed"])])
        yield from family("nsqd_cluster_problems", "gauge",
                          "Keys in etcd that do not decode, and topics that could not be applied.",
                          [("", len(cluster["problems"]))])

    yield from family("nsqd_topic_depth", "gauge",
                      "Messages held for channels that do not exist yet.",
                      [(tl[id(t)], t["depth"]) for t in topics])
    yield from family("nsqd_topic_paused", "gauge", "1 when the topic is paused.",
                      [(tl[id(t)], t["paused"]) for t in topics])
    yield from family("nsqd_topic_messages_total", "counter",
                      "Messages published to the topic on this node since start.",
                      [(tl[id(t)], t["message_count"]) for t in topics])
    yield from family("nsqd_topic_message_bytes_total", "counter",
                      "Body bytes published to the topic on this node since start.",
                      [(tl[id(t)], t["message_bytes"]) for t in topics])

    yield from family("nsqd_topic_partitions", "gauge", "Partitions of the topic (partition_num).",
                      [(tl[id(t)], t["partition_num"]) for t in topics if "partition_num" in t])
    yield from family("nsqd_partition_leader", "gauge", "1 when this node leads the partition.",
                      [(pl[id(p)], p.get("leader", True)) for t in topics
                       for p in t.get("partitions", [])])
    yield from family("nsqd_partition_up", "gauge",
                      "1 while the partition serves; 0 when it failed to open or its log failed.",
                      [(pl[id(p)], p.get("error") is None) for t, p in held])
    yield from family("nsqd_partition_depth", "gauge",
                      "Messages of the partition held for channels that do not exist yet.",
                      [(pl[id(p)], p["depth"]) for t, p in partitions])
    yield from family("nsqd_partition_start_offset", "gauge",
                      "Virtual offset of the oldest retained byte of the partition.",
                      [(pl[id(p)], p["start_offset"]) for t, p in partitions])
    yield from family("nsqd_partition_committed_offset", "gauge",
                      "Virtual offset up to which the partition's log is committed (readable).",
                      [(pl[id(p)], p["committed_offset"]) for t, p in partitions])
    yield from family("nsqd_partition_committed_count", "gauge",
                      "Messages in the partition's history up to the committed offset.",
                      [(pl[id(p)], p["committed_count"]) for t, p in partitions])
    yield from family("nsqd_partition_written_offset", "gauge",
                      "Virtual offset up to which the partition's log is written.",
                      [(pl[id(p)], p["written_offset"]) for t, p in partitions])
    yield from family("nsqd_partition_producers", "gauge",
                      "Idempotent producers the partition knows (their last sequences).",
                      [(pl[id(p)], p["producers"]) for t, p in partitions])
    yield from family("nsqd_partition_producer_duplicates_total", "counter",
                      "Idempotent producers' requests answered again, not written.",
                      [(pl[id(p)], p["producer_duplicates"]) for t, p in partitions])
    yield from family("nsqd_partition_half_waiting", "gauge",
                      "Half messages of the partition waiting for their commit or rollback.",
                      [(pl[id(p)], p["half_waiting"]) for t, p in partitions])
    yield from family("nsqd_partition_half_decided_total", "counter",
                      "Half messages decided since the partition opened here.",
                      [(f'{pl[id(p)]},decision="{d}"', p[f"half_{d}"]) for t, p in partitions
                       for d in ("committed", "rolled_back")])
    yield from family("nsqd_partition_half_checks_total", "counter",
                      "Check-backs made to half messages' producers.",
                      [(pl[id(p)], p["half_checks"]) for t, p in partitions])
    yield from family("nsqd_partition_half_expired_total", "counter",
                      "Half messages rolled back after their last check-back got no decision.",
                      [(pl[id(p)], p["half_expired"]) for t, p in partitions])
    gc_of = [(t, p, p["group_commit"]) for t, p in partitions if "group_commit" in p]
    yield from family("nsqd_group_commit_batch_messages", "histogram",
                      "Messages per batch written by the partition's group commit.",
                      [(pl[id(p)], g["batch_messages_histogram"]["le"],
                        g["batch_messages_histogram"]["counts"], g["batch_messages_total"])
                       for t, p, g in gc_of])
    yield from family("nsqd_group_commit_sync_seconds", "histogram",
                      "Seconds per sync of the partition's log.",
                      [(pl[id(p)], g["sync_seconds_histogram"]["le"],
                        g["sync_seconds_histogram"]["counts"], float(g["sync_seconds_total"]))
                       for t, p, g in gc_of])

    gauges = [
        ("nsqd_channel_depth", "depth", "Messages not yet delivered (unread plus requeued)."),
        ("nsqd_channel_backend_depth", "backend_depth", "Messages not yet read from the log."),
        ("nsqd_channel_in_flight", "in_flight_count", "Messages delivered and not finished."),
        ("nsqd_channel_deferred", "deferred_count", "Messages waiting for a due time."),
        ("nsqd_channel_delayed", "delayed_count", "Messages in the channel's disk delay queue."),
        ("nsqd_channel_requeued", "requeued_count", "Messages waiting for redelivery now."),
        ("nsqd_channel_clients", "client_count", "Clients subscribed."),
        ("nsqd_channel_paused", "paused", "1 when the channel is paused."),
        ("nsqd_channel_window", "window", "Messages taken and not yet confirmed past."),
        ("nsqd_channel_dead_letters", "dead_count", "Dead letters the channel keeps."),
        ("nsqd_channel_max_attempts", "max_attempts",
         "Deliveries after which a message is buried (0: never)."),
        ("nsqd_channel_confirmed_offset", "confirmed",
         "Offset before which every message is finished."),
    ]
    for name, key, help_text in gauges:
        yield from family(name, "gauge", help_text, [(cl[id(x[2])], x[2][key]) for x in channels])
    yield from family("nsqd_channel_delay_store_up", "gauge",
                      "0 when the channel's delay store failed (deferred messages wait in memory).",
                      [(cl[id(x[2])], x[2].get("delay_error") is None) for x in channels])
    yield from family("nsqd_channel_delay_oldest_due_seconds", "gauge",
                      "Unix time at which the oldest message of the disk delay queue is due.",
                      [(cl[id(x[2])], x[2]["delay_oldest_due_ms"] / 1000) for x in channels
                       if x[2]["delay_oldest_due_ms"] is not None])
    counters = [
        ("nsqd_channel_messages_total", "message_count",
         "Messages that reached the channel since it was opened."),
        ("nsqd_channel_requeues_total", "requeue_count", "Messages requeued by REQ."),
        ("nsqd_channel_timeouts_total", "timeout_count", "In-flight messages that timed out."),
        ("nsqd_channel_finishes_total", "finish_count", "Messages finished."),
        ("nsqd_channel_filtered_total", "filtered_count",
         "Messages auto-finished: no consumer's ext_filter took them."),
        ("nsqd_channel_buried_total", "buried_count",
         "Messages moved to the channel's dead letters since it was opened here."),
    ]
    for name, key, help_text in counters:
        yield from family(name, "counter", help_text, [(cl[id(x[2])], x[2][key]) for x in channels])
