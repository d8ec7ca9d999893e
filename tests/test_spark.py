"""The `nsq` PySpark data source and the replay job (spark/) against real nsqd processes and a
real cluster, through one local SparkSession shared by the module (about 10 s to start).

Single node (4 KiB segments): the exact message set of a time window, an empty window, a
window over several segments, timestamp and partition filters pushed down (the planned
ranges hold only the window), a window before retention (an error naming it, or a warning
and what is left), the endpoints' 4xx answers, bad options failing at load() before any job,
streaming into a Parquet sink exactly once across a restart of the query, and the replay
job into Parquet and into another topic. Cluster (etcd, nsqlookupd, 3 nsqd): 4 partitions,
R=2, read through nsqlookupd; a leader killed while the job runs (its tasks read from the
other replica), the result still exact.
"""

from __future__ import annotations

import datetime
import http.client
import json
import os
import socket
import struct
import sys
import threading
import time
import urllib.parse

import pytest

from cluster import Cluster, wait_until
from servers import ROOT, NsqdProcess

pyspark = pytest.importorskip("pyspark")

from pyspark.sql import SparkSession  # noqa: E402

from spark import client, replay  # noqa: E402
from spark.source import NsqReader, register  # noqa: E402
from spark.client import Options  # noqa: E402


# ---- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spark():
    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP", "PYTHONPATH")}
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)  # workers import this spark/
    session = (SparkSession.builder.master("local[2]").appName("test_spark")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.session.timeZone", "UTC").getOrCreate())
    register(session)
    yield session
    session.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def node(module_dir):
    """One nsqd with 4 KiB segments (a window spans several), no retention."""
    proc = NsqdProcess(str(module_dir / "n"), "--segment-bytes", "4096",
                       "--retention-check-interval", "1h").start()
    yield proc
    proc.kill()


class Publisher:
    """POST /pub on one kept-alive connection."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=10)

    def pub(self, topic: str, body: bytes, partition: int | None = None) -> None:
        """A 503 or E_FAILED_ON_NOT_LEADER (a new replicated partition not writable here
        yet) is retried for up to 10 s, as a client retries it."""
        q = {"topic": topic, **({"partition": partition} if partition is not None else {})}
        deadline = time.monotonic() + 10
        while True:
            self.conn.request("POST", "/pub?" + urllib.parse.urlencode(q), body=body)
            r = self.conn.getresponse()
            answer = (r.status, r.read())
            settling = answer[0] == 503 or b"E_FAILED_ON_NOT_LEADER" in answer[1]
            if not settling or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert answer == (200, b"OK")

    def close(self):
        self.conn.close()


def get(address: str, path: str) -> tuple[int, dict]:
    return client.get_json(address, path, 10)


def publish_groups(address: str, topic: str, groups: list[list[bytes]]) -> list[float]:
    """Publish each group (one /pub a message), 0.2 s apart; returns a time between each
    group and the next (unix s), so [cuts[i-1], cuts[i]) holds exactly group i."""
    p = Publisher(address)
    cuts = []
    for i, group in enumerate(groups):
        if i:
            time.sleep(0.1)
            cuts.append(time.time())
            time.sleep(0.1)
        for body in group:
            p.pub(topic, body)
    p.close()
    return cuts


def rows_of(df) -> list[tuple[str, bytes]]:
    return sorted((r.msg_id, bytes(r.body)) for r in df.select("msg_id", "body").collect())


def expected(bodies: list[bytes], first: int = 0, partition: int = 0) -> list[tuple[str, bytes]]:
    return sorted((f"{partition << 50 | first + i:016x}", b) for i, b in enumerate(bodies))


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()


def jobs(spark) -> int:
    return len(spark.sparkContext.statusTracker().getJobIdsForGroup(None))


# ---- single node ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def groups(node):
    """Topic `pay`: three groups of 60 messages of ~200 B, 0.2 s apart."""
    gs = [[b"g%d-%03d-" % (g, i) + b"x" * 190 for i in range(60)] for g in range(3)]
    cuts = publish_groups(node.http_address, "pay", gs)
    return gs, cuts


def read(spark, node, **options):
    r = spark.read.format("nsq").option("nsqd", node.http_address).option("topic", "pay")
    for k, v in options.items():
        r = r.option(k, str(v))
    return r.load()


def test_a_window_is_exactly_its_messages_across_segments(spark, node, groups):
    gs, (t1, t2) = groups
    segments = os.listdir(os.path.join(node.data_path, "pay.topic", "0", "data"))
    df = read(spark, node, since=iso(t1), until=iso(t2))
    assert rows_of(df) == expected(gs[1], first=60)
    data_files = [s for s in segments if s.endswith(".dat")]
    assert len(data_files) >= 4, segments  # group 1 alone is ~14 KB: it spans segments
    # the whole topic without a window, split in many small pieces
    whole = read(spark, node, max_partition_bytes=8000)
    assert whole.rdd.getNumPartitions() >= 5
    rows = whole.collect()
    assert sorted((r.msg_id, bytes(r.body)) for r in rows) == expected(gs[0] + gs[1] + gs[2])
    row = next(r for r in rows if r.offset == 0)
    assert (row.topic, row.partition, row.attempts, row.trace_id, row.ext) == ("pay", 0, 0, 0, {})
    assert t1 - 5 < row.timestamp.timestamp() < t1


def test_an_empty_window(spark, node, groups):
    gs, (t1, t2) = groups
    assert read(spark, node, since=t1 + 0.02, until=t1 + 0.05).count() == 0  # unix seconds
    future = NsqReader(Options.parse({"nsqd": node.http_address, "topic": "pay",
                                      "since": str(time.time() + 3600)}))
    assert future.plan() == []


def test_timestamp_and_partition_filters_are_pushed_down(spark, node, groups):
    gs, (t1, t2) = groups
    df = read(spark, node)
    lo = datetime.datetime.fromtimestamp(t1, datetime.timezone.utc)
    hi = datetime.datetime.fromtimestamp(t2, datetime.timezone.utc)
    got = df.where((df.timestamp >= lo) & (df.timestamp < hi) & (df.partition == 0))
    assert rows_of(got) == expected(gs[1], first=60)
    assert rows_of(df.where(df.timestamp > hi)) == expected(gs[2], first=120)
    # the reader takes them all: its plan covers the window's bytes only (no scan)
    from pyspark.sql.datasource import EqualTo, GreaterThanOrEqual, LessThan, LessThanOrEqual
    r = NsqReader(Options.parse({"nsqd": node.http_address, "topic": "pay"}))
    left = list(r.pushFilters([GreaterThanOrEqual(("timestamp",), lo),
                               LessThan(("timestamp",), hi), EqualTo(("partition",), 0)]))
    assert left == []
    planned = r.plan()
    _, whole = get(node.http_address, "/topic/offsets?topic=pay&partition=0")
    size = whole["end"] // 3
    assert sum(s.end - s.start for s in planned) < size * 1.2
    assert sum(s.rows for s in planned) == 60
    r = NsqReader(Options.parse({"nsqd": node.http_address, "topic": "pay"}))
    assert list(r.pushFilters([LessThanOrEqual(("timestamp",), lo), EqualTo(("partition",), 1)
                               ])) == []
    assert r.plan() == []  # no partition 1 here
    r = NsqReader(Options.parse({"nsqd": node.http_address, "topic": "pay"}))
    assert list(r.pushFilters([LessThanOrEqual(("timestamp",), lo)])) == []
    assert sum(s.rows for s in r.plan()) == 60


def test_the_endpoints_answer_bad_input_with_4xx_json(node, groups):
    a = node.http_address
    assert get(a, "/topic/offsets?topic=nope")[0] == 404
    assert get(a, "/topic/offsets?topic=pay&since=yesterday") == (
        400, {"message": "INVALID_SINCE", "detail": "since 'yesterday': unix seconds or ISO 8601"})
    assert get(a, "/topic/offsets?topic=pay&since=10&until=5")[1]["message"] == "UNTIL_BEFORE_SINCE"
    assert get(a, "/topic/read?topic=pay&partition=0")[1]["message"] == "MISSING_ARG_OFFSET"
    assert get(a, "/topic/read?topic=pay&partition=0&offset=-1")[1]["message"] == "INVALID_OFFSET"
    assert get(a, "/topic/read?topic=pay&partition=7&offset=0") == (
        404, {"message": "PARTITION_NOT_HERE", "partition": 7})
    status, body = get(a, "/topic/read?topic=pay&partition=0&offset=99999999")
    assert status == 416 and body["message"] == "OFFSET_NOT_COMMITTED"
    assert get(a, "/topic/read?topic=pay&offset=0")[1]["message"] == "MISSING_ARG_PARTITION"
    # an offset inside a record starts at the next record; `end` cuts by records' starts
    _, w = get(a, "/topic/offsets?topic=pay&partition=0")
    host, port = a.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port))
    conn.request("GET", "/topic/read?topic=pay&partition=0&offset=1&end=300")
    r = conn.getresponse()
    data = r.read()
    start = int(r.headers["X-NSQ-Start"])
    assert client.frame(data, start, 0) == ([0], len(data))
    assert 1 < start < 300 <= start + len(data) and w["count"] == 180


def test_dead_letter_records_are_not_rows():
    """Pure: a channel's dead copies and their changes (nsqd/deadletters.py) are records
    of the log but not messages of the topic: no row."""
    from diskqueue.record import encode_into
    from nsqd.deadletters import bury_ext, purge_ext

    buf = bytearray()
    encode_into(buf, 7, 0, 1, 0, b"", b"a")
    encode_into(buf, 8, 0, 2, 0, bury_ext(b"", "ch", 7, 3, "req", None, 1), b"a")
    encode_into(buf, 9, 0, 3, 0, b'{"k":"##dead"}', b"b")  # the marker as a value: a message
    encode_into(buf, 10, 0, 4, 0, purge_ext("ch", [1]), b"")
    places, used = client.frame(bytes(buf), 0, 0)
    rows = client.to_batch("t", 0, bytes(buf), 0, places).to_pylist()
    assert [(r["msg_id"][-1], r["body"]) for r in rows] == [("7", b"a"), ("9", b"b")]


def test_half_records_are_not_rows_but_their_commits():
    """Pure: a half message, a rollback and a roll-call (nsqd/halves.py) are no message of
    the topic; a commit is the message."""
    from diskqueue.record import encode_into
    from nsqd.halves import with_half

    buf = bytearray()
    encode_into(buf, 1, 0, 1, 0, with_half(b"", {"check": "http://x/"}), b"debit")
    encode_into(buf, 2, 0, 2, 0, with_half(b"", {"check": "http://x/"}), b"credit")
    encode_into(buf, 3, 0, 3, 0, with_half(b"", {"commit": 0}), b"debit")
    encode_into(buf, 4, 0, 4, 0, with_half(b"", {"rollback": 40}), b"")
    encode_into(buf, 5, 0, 5, 0, with_half(b"", {"roll_call": 0}), b'{"urls":[],"waiting":[]}')
    places, used = client.frame(bytes(buf), 0, 0)
    rows = client.to_batch("t", 0, bytes(buf), 0, places).to_pylist()
    assert [(r["msg_id"][-1], r["body"]) for r in rows] == [("3", b"debit")]


def test_records_to_arrow_fields_ext_and_a_flipped_bit():
    """Pure: every field of the record format lands in its column (a trace id above 2^63 as
    the signed long of its bits, the ext header's JSON as a map); a flipped bit anywhere in
    a record is refused, never handed out."""
    from diskqueue.record import encode_into

    buf = bytearray()
    encode_into(buf, 3 << 50 | 7, (1 << 64) - 2, 1_795_686_829_123_456_789, 4,
                b'{"tag":"a","n":1}', b"first")
    encode_into(buf, 3 << 50 | 8, 5, 1_795_686_829_123_457_000, 0, b"", b"")
    encode_into(buf, 3 << 50 | 9, 0, 1_795_686_829_123_458_000, 0, b"[1]", b"x" * 300)
    data = bytes(buf) + b"\x00\x01"  # and a partial record after them
    places, used = client.frame(data, 1000, 3)
    assert used == len(buf) and len(places) == 3
    rows = client.to_batch("t", 3, data[:used], 1000, places).to_pylist()
    assert [(r["offset"], r["msg_id"], r["trace_id"], r["attempts"], r["body"]) for r in rows] == [
        (1000, "000c000000000007", -2, 4, b"first"),
        (1000 + places[1], "000c000000000008", 5, 0, b""),
        (1000 + places[2], "000c000000000009", 0, 0, b"x" * 300)]
    assert [r["ext"] for r in rows] == [[("tag", "a"), ("n", "1")], [], [("_raw", "[1]")]]
    assert rows[0]["timestamp"] == datetime.datetime(2026, 11, 26, 9, 53, 49, 123456,
                                                     tzinfo=datetime.timezone.utc)
    for i in range(len(buf)):
        bad = bytearray(buf)
        bad[i] ^= 0x10
        try:
            got, _ = client.frame(bytes(bad), 0, 3)
        except client.NsqSourceError:
            continue
        assert len(got) < 3, i  # a changed length hides the rest: never a wrong record
    with pytest.raises(client.NsqSourceError, match="not of partition 2"):
        client.frame(bytes(buf), 0, 2)


class CuttingProxy:
    """A TCP proxy to `target` that cuts its first connection once `cut_after` bytes of the
    answer went through (a node that fails half-way through a read); the later ones pass
    whole."""

    def __init__(self, target: str, cut_after: int):
        self.target, self.cut_after = target, cut_after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            limit = self.cut_after if self.connections == 1 else None
            host, port = self.target.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)), timeout=10)
            threading.Thread(target=self._pump, args=(downstream, upstream, None),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, limit),
                             daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[:limit - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for sock in (src, dst):  # shut down first: wakes the other direction's recv
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()


def test_a_long_read_cut_late_goes_on_from_its_last_record(node):
    """A split read for longer than `retry_s` (its consumer is slow), then cut by its node:
    the read goes on from the last whole record, since its wait for a record starts again
    with each batch (before, the wait ran from the split's start and the task failed)."""
    body = struct.pack(">I", 100) + b"".join(
        struct.pack(">I", 1000) + b"%06d" % i + b"x" * 994 for i in range(100))
    for _ in range(30):  # 3 MB: three of READ_BYTES
        host, port = node.http_address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/mpub?topic=long&binary=true", body=body)
        assert conn.getresponse().status == 200
        conn.close()
    _, w = get(node.http_address, "/topic/offsets?topic=long&partition=0")
    proxy = CuttingProxy(node.http_address, cut_after=5 * (1 << 20) // 2)
    try:
        split = client.Split("long", 0, w["start"], w["end"], [proxy.address])
        got = []
        for batch in client.read_split(split, retry_s=0.3):
            got += batch.column("body").to_pylist()
            time.sleep(0.4)  # longer than retry_s: a slow consumer
        assert proxy.connections == 2  # the cut one, then the rest
        assert [b[:6] for b in got] == [b"%06d" % i for i in range(100)] * 30
    finally:
        proxy.close()


def test_bad_options_fail_at_load_before_any_job(spark, node, groups):
    before = jobs(spark)
    cases = [
        ({"nsqd": node.http_address, "topic": "nope"}, "topic 'nope' not found"),
        ({"nsqd": node.http_address, "topic": "pay", "since": "2026-11-02",
          "until": "2026-11-01"}, "'until' (2026-11-01) is before 'since' (2026-11-02)"),
        ({"nsqd": "127.0.0.1:1", "topic": "pay"}, "no nsqd answered"),
        ({"lookupd": "127.0.0.1:1", "topic": "pay"}, "no nsqlookupd answered"),
        ({"topic": "pay"}, "give exactly one of the options 'lookupd'"),
        ({"nsqd": node.http_address, "topic": "pay", "since": "monday"}, "neither unix"),
        ({"nsqd": node.http_address, "topic": "pay", "max_partition_bytes": "0"},
         "'max_partition_bytes' must be a positive number"),
    ]
    for options, message in cases:
        with pytest.raises(Exception) as e:
            spark.read.format("nsq").options(**options).load()
        assert message in str(e.value), (options, str(e.value)[:600])
    assert jobs(spark) == before


def test_a_window_before_retention_says_so(spark, tmp_path):
    proc = NsqdProcess(str(tmp_path / "r"), "--segment-bytes", "2048", "--retention-max-bytes",
                       "4096", "--retention-check-interval", "100ms").start()
    try:
        bodies = [b"r%03d-" % i + b"y" * 200 for i in range(60)]
        publish_groups(proc.http_address, "old", [bodies])
        seen = []

        def settled():  # retention dropped segments, and drops no more (4 KiB kept)
            seen.append(get(proc.http_address, "/topic/offsets?topic=old&partition=0"
                            )[1]["retention_start_count"])
            return len(seen) > 5 and seen[-1] == seen[-5] > 0 and seen[-1]

        kept = wait_until(settled, 20, "retention dropped", interval=0.1)
        _, w = get(proc.http_address, "/topic/offsets?topic=old&partition=0&since=0")
        assert w["before_retention"] is True and w["start_count"] == kept
        load = spark.read.format("nsq").option("nsqd", proc.http_address).option("topic", "old")
        with pytest.raises(Exception) as e:
            load.option("since", "0").load().collect()
        assert "window starts before the oldest record kept" in str(e.value)
        assert "older messages were dropped by retention" in str(e.value)
        got = rows_of(load.option("since", "0").option("before_retention", "warn").load())
        assert got == expected(bodies[kept:], first=kept)
        # a split planned before retention dropped its start: the task says so at once
        gone = client.Split("old", 0, 0, 100, [proc.http_address])
        with pytest.raises(client.NsqSourceError, match="retention dropped offset 0"):
            list(client.read_split(gone, retry_s=60))
        # a window after what retention dropped is not before it
        _, w = get(proc.http_address, f"/topic/offsets?topic=old&partition=0&since={time.time()}")
        assert w["before_retention"] is False and w["count"] == 0
    finally:
        proc.kill()


def test_streaming_into_a_file_sink_exactly_once_across_a_restart(spark, node, tmp_path):
    out, checkpoint = str(tmp_path / "out"), str(tmp_path / "checkpoint")
    p = Publisher(node.http_address)
    published = []

    def publish(n: int) -> None:
        for _ in range(n):
            body = b"s%04d" % len(published)
            p.pub("stream", body)
            published.append(body)

    def start():
        df = (spark.readStream.format("nsq").option("nsqd", node.http_address)
              .option("topic", "stream").load().select("msg_id", "partition", "offset", "body"))
        return (df.writeStream.format("parquet").option("path", out)
                .option("checkpointLocation", checkpoint).trigger(processingTime="200 milliseconds")
                .start())

    publish(30)
    q = start()
    publisher = threading.Thread(target=publish, args=(60,))
    publisher.start()  # while the stream runs
    publisher.join()
    q.processAllAvailable()
    q.stop()
    publish(25)  # while it is stopped
    q = start()
    publish(15)
    q.processAllAvailable()
    q.stop()
    p.close()
    rows = spark.read.parquet(out).collect()
    ids = sorted(r.msg_id for r in rows)
    assert len(ids) == len(set(ids)) == len(published) == 130
    assert sorted(bytes(r.body) for r in rows) == sorted(published)
    assert ids == [f"{i:016x}" for i in range(130)]


def test_replay_into_parquet_and_into_another_topic(spark, node, groups, tmp_path, capsys):
    gs, (t1, t2) = groups
    path = str(tmp_path / "pq")
    args = replay.parse_args(["--nsqd", node.http_address, "--topic", "pay", "--since", iso(t1),
                              "--until", iso(t2), "--to", f"parquet:{path}", "--progress-s", "0.2"])
    summary = replay.run(args, spark)
    assert summary["rows"] == 60 and summary["partitions"] == {"0": 60}
    assert sorted(bytes(r.body) for r in spark.read.parquet(path).collect()) == sorted(gs[1])
    out = capsys.readouterr().out
    assert "done: 60 rows" in out and json.loads(out.strip().splitlines()[-1])["rows"] == 60
    # republished in order into another topic (one partition here: order is the source's)
    args = replay.parse_args(["--nsqd", node.http_address, "--topic", "pay", "--since", iso(t1),
                              "--to", "topic:pay-fixed", "--batch", "7"])
    replay.run(args, spark)
    again = spark.read.format("nsq").option("nsqd", node.http_address).option(
        "topic", "pay-fixed").load().orderBy("offset").collect()
    assert [bytes(r.body) for r in again] == gs[1] + gs[2]


def test_replay_reads_times_as_nsqadmin_does_once_at_start():
    before = time.time()
    args = replay.parse_args(["--nsqd", "h:1", "--topic", "t", "--since", "-1h", "--until",
                              "2026-11-26T10:00:00.000001Z", "--to", "parquet:/x"])
    assert before - 3600 <= float(args.since) <= time.time() - 3600
    assert args.until == "1795687200.000001"  # to the microsecond, as the source takes it
    args = replay.parse_args(["--nsqd", "h:1", "--topic", "t", "--since=30m ago", "--until",
                              "now", "--to", "parquet:/x"])
    assert float(args.until) - float(args.since) == pytest.approx(1800, abs=1e-3)
    for bad in ("-1x", "yesterday", "1795658400000"):
        with pytest.raises(SystemExit):
            replay.parse_args(["--nsqd", "h:1", "--topic", "t", "--since", bad,
                               "--to", "parquet:/x"])


def test_replay_refuses_bad_targets():
    with pytest.raises(SystemExit):
        replay.parse_args(["--nsqd", "h:1", "--topic", "t", "--to", "s3:x"])
    with pytest.raises(SystemExit):
        replay.parse_args(["--nsqd", "h:1", "--topic", "t", "--to", "parquet:/x",
                           "--key-field", "k"])


# ---- cluster ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(module_dir):
    cl = Cluster(str(module_dir / "cluster"), 3, 1).start()
    yield cl
    cl.stop()


def test_replay_keyed_into_a_topic_of_other_partitions_keeps_per_key_order(spark, cluster):
    """Source: 2 partitions, keys spread over both; target: 4 partitions. Each key's messages
    land in partition_of(key, 4), in their source order."""
    from nsqwire.partitioning import partition_of

    for topic, n in (("ksrc", 2), ("kdst", 4)):
        status, answer = cluster.create_topic(topic, n)
        assert status == 200, answer
    leaders = wait_until(lambda: len(cluster.leaders("ksrc")) == 2 and cluster.leaders("ksrc"),
                         15, "ksrc led")
    wait_until(lambda: len(cluster.leaders("kdst")) == 4, 15, "kdst led")
    sent: dict[str, list[int]] = {}
    for n, tcp in leaders.items():  # each key's messages in one source partition
        p = Publisher(cluster.nsqd_at(tcp).http_address)
        for i in range(40):
            key = f"k{n}-{i % 3}"
            sent.setdefault(key, []).append(i)
            p.pub("ksrc", json.dumps({"key": key, "i": i}).encode(), partition=n)
        p.close()
    lookupd = cluster.lookupds[0].http_address
    args = replay.parse_args(["--lookupd", lookupd, "--topic", "ksrc", "--to", "topic:kdst",
                              "--key-field", "key", "--batch", "4"])
    assert replay.run(args, spark)["rows"] == 80
    rows = (spark.read.format("nsq").option("lookupd", lookupd).option("topic", "kdst").load()
            .select("partition", "offset", "body").collect())
    got: dict[str, list[tuple[int, int, int]]] = {}
    for r in rows:
        doc = json.loads(bytes(r.body))
        got.setdefault(doc["key"], []).append((r.partition, r.offset, doc["i"]))
    assert sorted(got) == sorted(sent)
    for key, placed in got.items():
        assert {p for p, _, _ in placed} == {partition_of(key, 4)}, key
        assert [i for _, _, i in sorted(placed)] == sent[key], key


def test_four_partitions_on_three_nodes_and_a_leader_killed_during_the_read(spark, cluster):
    status, answer = cluster.create_topic("cpay", 4, replicas=2)
    assert status == 200, answer
    leaders = wait_until(lambda: len(cluster.leaders("cpay")) == 4 and cluster.leaders("cpay"),
                         15, "4 partitions led")
    assert len(set(leaders.values())) == 3
    bodies = {}
    for n, tcp in leaders.items():
        p = Publisher(cluster.nsqd_at(tcp).http_address)
        bodies[n] = [b"p%d-%03d-" % (n, i) + b"z" * 150 for i in range(150)]
        for b in bodies[n]:
            p.pub("cpay", b, partition=n)
        p.close()
    want = sorted(r for n in range(4) for r in expected(bodies[n], partition=n))
    lookupd = cluster.lookupds[0].http_address

    def load(**options):
        r = spark.read.format("nsq").option("lookupd", lookupd).option("topic", "cpay")
        for k, v in options.items():
            r = r.option(k, str(v))
        return r.load()

    assert rows_of(load()) == want
    assert rows_of(load().where("partition in (1, 3)")) == sorted(
        r for n in (1, 3) for r in expected(bodies[n], partition=n))
    # every follower is level with its leader before the kill (what the read needs)
    for n, tcp in leaders.items():
        _, w = get(cluster.nsqd_at(tcp).http_address, f"/topic/offsets?topic=cpay&partition={n}")
        assert len(w["replicas"]) == 2
        wait_until(lambda: get(w["replicas"][1], f"/topic/offsets?topic=cpay&partition={n}"
                               )[1].get("committed_end") == w["end"], 10, "follower level")

    # many small tasks; a leader is SIGKILLed once the first ones are done
    df = load(max_partition_bytes=2048)
    result: dict = {}
    job = threading.Thread(target=lambda: result.update(rows=rows_of(df)))
    tracker = spark.sparkContext.statusTracker()
    job.start()

    def some_done():
        for s in tracker.getActiveStageIds():
            info = tracker.getStageInfo(s)
            if info and info.numTasks > 20 and 0 < info.numCompletedTasks < info.numTasks - 10:
                return True
        return False

    wait_until(some_done, 60, "the read job under way", interval=0.01)
    victim = cluster.nsqd_at(leaders[max(leaders)])
    victim.kill()
    assert job.is_alive()
    job.join(120)
    assert result["rows"] == want
