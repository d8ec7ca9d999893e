"""The replay job: a topic's window into Parquet, or republished into another topic.

    python -m spark.replay --lookupd 127.0.0.1:4161 --topic payments \\
        --since 2026-11-23T00:00:00Z --until 2026-11-24T00:00:00Z --to parquet:/data/pay
    python -m spark.replay --lookupd 127.0.0.1:4161 --topic payments --since -1h \\
        --to topic:payments-fixed --key-field customer

`--since` and `--until` are read as nsqadmin reads a person's times (nsqadmin/times.py:
ISO 8601, UTC without a zone; unix seconds; before now: `-1h`, `30m ago`, `now`), once,
when the job starts: the planned window and the written one are the same.

`--to topic:T2` publishes through nsqclient's partition-aware Producer, keyed by
`--key-field` (a field of the body's JSON object, or `ext:NAME` for a key of the ext
header): rows go to Spark partitions by key and are sorted by (timestamp, partition,
offset) inside them, and one task publishes a key's messages in that order, each MPUB
awaited before the next, so per-key order is kept. Without a key, rows are published in
that order, in MPUBs of up to `--batch` messages, to the target's partitions in turn.
In cluster mode, create T2 first (nsqlookupd's /topic/create) with the partitions you want.

Progress every `--progress-s` seconds on stderr (tasks done, rows and bytes estimated from
the plan, per second); a summary at the end (rows per partition, time, rate) and one line
of JSON. Runs on `local[*]` by default, its driver on 127.0.0.1 (SPARK_LOCAL_IP, when not
set already); `--master spark://host:7077` for a cluster (each executor needs this project
importable and the nodes' HTTP ports reachable).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

from nsqadmin.times import BadTime, parse_time

from . import client
from .client import NsqSourceError, Options


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m spark.replay", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lookupd", help="nsqlookupd HTTP addresses, comma-separated")
    src.add_argument("--nsqd", help="nsqd HTTP addresses, comma-separated (one node)")
    p.add_argument("--topic", required=True)
    p.add_argument("--since", help="ISO 8601, unix seconds or before now (-1h, 30m ago) "
                                   "(default: the oldest kept)")
    p.add_argument("--until", help="as --since (default: the committed end)")
    p.add_argument("--to", required=True, help="parquet:PATH or topic:NAME")
    p.add_argument("--key-field", help="body JSON field (or ext:NAME) keying republished rows")
    p.add_argument("--mode", default="errorifexists", help="Parquet save mode")
    p.add_argument("--master", default="local[*]")
    p.add_argument("--max-partition-bytes", type=int, default=16 << 20)
    p.add_argument("--before-retention", choices=("error", "warn"), default="error")
    p.add_argument("--batch", type=int, default=256, help="messages per MPUB when republishing")
    p.add_argument("--progress-s", type=float, default=2.0)
    glued: list[str] = []  # `--since -1h` as `--since=-1h`: argparse takes "-1h" for a flag
    for arg in sys.argv[1:] if argv is None else argv:
        if glued and glued[-1] in ("--since", "--until"):
            glued[-1] += "=" + arg
        else:
            glued.append(arg)
    args = p.parse_args(glued)
    kind, _, target = args.to.partition(":")
    if kind not in ("parquet", "topic") or not target:
        p.error("--to is parquet:PATH or topic:NAME")
    args.to_kind, args.target = kind, target
    if args.key_field and kind != "topic":
        p.error("--key-field is for --to topic:NAME")
    now = time.time()
    for name in ("since", "until"):  # unix seconds to the microsecond, as the source takes them
        if getattr(args, name):
            try:
                setattr(args, name, f"{parse_time(getattr(args, name), now, '--' + name):.6f}")
            except BadTime as e:
                p.error(str(e))
    return args


def source_options(args) -> dict:
    o = {"topic": args.topic, "max_partition_bytes": str(args.max_partition_bytes),
         "before_retention": args.before_retention}
    for name in ("lookupd", "nsqd", "since", "until"):
        if getattr(args, name):
            o[name] = getattr(args, name)
    return o


def session(master: str, name: str = "nsq-replay"):
    """A SparkSession for the job (workers run this interpreter; in local mode no UI, and
    the driver binds 127.0.0.1 unless SPARK_LOCAL_IP says otherwise)."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get(
            "PYTHONPATH")) if p)
    builder = (SparkSession.builder.master(master).appName(name)
               .config("spark.sql.python.filterPushdown.enabled", "true")
               .config("spark.sql.session.timeZone", "UTC"))
    if master.startswith("local"):
        builder = builder.config("spark.ui.enabled", "false")
    return builder.getOrCreate()


class Progress(threading.Thread):
    """Prints tasks done and estimated rows and bytes per second while the job runs."""

    def __init__(self, spark, rows: int, size: int, every_s: float, out=None):
        super().__init__(daemon=True)
        self.tracker = spark.sparkContext.statusTracker()
        self.rows, self.size, self.every_s, self.out = rows, size, every_s, out or sys.stderr
        self.started = time.monotonic()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            done = total = 0
            for stage_id in self.tracker.getActiveStageIds():
                info = self.tracker.getStageInfo(stage_id)
                if info is not None:
                    done += info.numCompletedTasks
                    total += info.numTasks
            if not total:
                continue
            took = time.monotonic() - self.started
            share = done / total
            print(f"progress: {done}/{total} tasks, ~{int(self.rows * share):,} rows, "
                  f"~{self.rows * share / took:,.0f} rows/s, "
                  f"~{self.size * share / took / 1e6:.1f} MB/s", file=self.out, flush=True)


def _key_column(df, key_field: str):
    from pyspark.sql import functions as F

    if key_field.startswith("ext:"):
        return F.col("ext")[key_field[4:]]
    return F.get_json_object(F.col("body").cast("string"), f"$.{key_field}")


def publisher(lookupd: list[str], nsqd_tcp: str | None, topic: str, batch: int):
    """The function each task runs over its rows (key, body): publishes them in order."""

    def publish_rows(rows) -> None:
        from nsqclient.lookup import StaticLookup
        from nsqclient.producer import Producer

        async def run() -> None:
            if nsqd_tcp is not None:
                static = StaticLookup()
                static.set(topic, None, producers=[nsqd_tcp])
                producer = Producer(lookup=static)
            else:
                producer = Producer(lookupd)
            try:
                key, bodies = None, []
                for row in rows:
                    if bodies and (row.key != key or len(bodies) >= batch):
                        await producer.publish_many(topic, bodies, key=key)
                        bodies = []
                    key = row.key
                    bodies.append(bytes(row.body))
                if bodies:
                    await producer.publish_many(topic, bodies, key=key)
            finally:
                await producer.close()

        asyncio.run(run())

    return publish_rows


def _nsqd_tcp(address: str, timeout: float) -> str:
    status, info = client.get_json(address, "/info", timeout)
    if status != 200:
        raise NsqSourceError(f"nsqd {address}: /info answered HTTP {status}")
    host = info.get("broadcast_address") or address.rpartition(":")[0]
    return f"{host}:{info['tcp_port']}"


def run(args, spark=None, out=None) -> dict:
    """The job: plan (and check) the window, write it, print and return the summary."""
    out = out or sys.stdout
    from pyspark.sql import functions as F

    from .source import register

    options = source_options(args)
    o = Options.parse(options)
    ws = client.windows(o)
    for note in client.check_retention(o, ws):
        print(f"warning: {note}", file=sys.stderr)
    rows = sum(w.count for w in ws)
    size = sum(w.end - w.start for w in ws)
    print(f"window: {rows:,} messages, {size / 1e6:.1f} MB in {len(ws)} partitions of "
          f"{args.topic}", file=out, flush=True)
    spark = spark or session(args.master)
    register(spark)
    df = spark.read.format("nsq").options(**options).load()
    started = time.monotonic()
    progress = Progress(spark, rows, size, args.progress_s)
    progress.start()
    try:
        if args.to_kind == "parquet":
            df.write.mode(args.mode).parquet(args.target)
        else:
            key = _key_column(df, args.key_field) if args.key_field else F.lit(None)
            ordered = df.select(key.cast("string").alias("key"), "body", "timestamp",
                                "partition", "offset")
            if args.key_field:
                ordered = ordered.repartition("key")
            ordered = ordered.sortWithinPartitions("timestamp", "partition", "offset")
            tcp = _nsqd_tcp(o.nsqd[0], o.timeout_s) if o.nsqd else None
            ordered.select("key", "body").foreachPartition(
                publisher(o.lookupd, tcp, args.target, args.batch))
    finally:
        progress.done.set()
    took = time.monotonic() - started
    summary = {"topic": args.topic, "to": args.to, "rows": rows, "bytes": size,
               "seconds": round(took, 3), "rows_per_s": round(rows / took) if took else None,
               "partitions": {str(w.partition): w.count for w in ws}}
    print(f"done: {rows:,} rows ({size / 1e6:.1f} MB) in {took:.2f} s, "
          f"{summary['rows_per_s'] or 0:,} rows/s", file=out)
    for w in ws:
        print(f"  partition {w.partition}: {w.count:,} rows, offsets {w.start}..{w.end}",
              file=out)
    print(json.dumps(summary), file=out, flush=True)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except NsqSourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
