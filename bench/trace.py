"""What message trace costs, and how fast its store answers.

1. Throughput, tracing off vs on for every message (`--trace-all`, the SQLite store), in
   one run: a fresh nsqd (bench/nsqd_server.py) each time; 4 publishers each keep 64 PUBs
   in flight (one message per PUB: the per-message path), one consumer (RDY 500, a FIN per
   message) takes them as they come; the figure is messages published and finished per
   second, wall clock from the first PUB to the last FIN (off and on alternated 3 times,
   the best of each; also each round's own loss and their median, steadier when one off
   run is lucky), and nsqd's CPU per message: all of it, its event loop's (the main
   thread), the other threads' (the trace writer, file work), and with tracing on the
   CPU of the SQLite store's own process (trace/process.py), read after it wrote all.
   With tracing on, /stats `trace` gives the events written and dropped.
   Also on with the Elasticsearch sink (`--trace-es-url`) against osmem-server (an
   in-memory OpenSearch-API server, PyPI) through tests/esproxy.py's media-type proxy, a
   thread of this script (skipped when osmem-server is not installed): the proxy and
   osmem-server share the machine's 2 cores with nsqd, so this is a floor, not ES's speed.
2. The switched-off hook: what `if x.trace is not None` costs (timeit), times the hooks a
   message passes (publish, deliver, finish), as a share of nsqd's CPU per message.
3. Search by message id: a store of 10 million events (`--quick`: 1 million; 3 per
   message: PUB, DELIVER, FIN) is built with the store's own write path, a real nsqd opens
   it as its trace store, and 1,000 random ids are searched over HTTP
   (`GET /trace/search?msg_id=`) and directly (nsqtrace.store.search): p50, p99.
   Then one client's single PUBs, one at a time, for 10 s quiet and 10 s while 4 others
   flood the node with the heaviest search (its topic, 10,000 events each): each PUB's
   round trip, p50 / p99 / max (a search must not take the event loop from publishers).
4. Converting an old store: the same events as a store of version 2 (a row per event,
   made by SQL here: its writer is gone), then opened by the current store, which
   converts it to chunks: wall clock, CPU per event, the file before and after.

    .venv/bin/python bench/trace.py [--quick] [--dir /mnt/fast]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the bench modules are imported as bench.*
    sys.path.append(ROOT)
from bench.common import Report, machine_info, percentile  # noqa: E402
from bench.nsqd_server import Server, _load_servers, pid_cpu_seconds  # noqa: E402
from nsqtrace.store import TraceStore, search  # noqa: E402
from nsqwire import commands as c  # noqa: E402
from nsqwire import protocol as p  # noqa: E402

TOPIC = "bench_trace"
PUBLISHERS = 4
WINDOW = 64
ROUNDS = 3
FLOODERS = 4  # clients searching at once, in the search flood
FLOOD_S = 10.0


class OsmemSink:
    """osmem-server and the media-type proxy in front of it (tests/esproxy.py)."""

    def __enter__(self) -> "OsmemSink":
        import osmem_server
        spec = importlib.util.spec_from_file_location(
            "_bench_esproxy", os.path.join(ROOT, "tests", "esproxy.py"))
        esproxy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(esproxy)
        port = _load_servers().free_port()
        self.osmem = subprocess.Popen(
            [osmem_server.resolve_binary(), "-addr", f"127.0.0.1:{port}", "-no-stdin-watch",
             "-parent-pid", str(os.getpid())],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.proxy = esproxy.MediaTypeProxy(f"127.0.0.1:{port}").start()
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        self.url = self.proxy.url
        return self

    def drop(self, prefix: str) -> None:
        """Delete a round's indices (osmem-server keeps everything in memory)."""
        req = urllib.request.Request(f"{self.url}/{prefix}*", method="DELETE")
        urllib.request.urlopen(req, timeout=60).read()

    def __exit__(self, *exc) -> None:
        self.proxy.close()
        self.osmem.kill()
        self.osmem.wait()


def loop_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a process's main thread: nsqd's event loop."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(address: str, path: str) -> dict:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=30) as r:
        return json.loads(r.read())


async def publisher(server, count: int) -> None:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    frames = c.FrameParser()
    writer.write(p.MAGIC_V2)
    body = b"x" * 200
    sent = acked = 0
    while acked < count:
        while sent < count and sent - acked < WINDOW:
            writer.write(c.cmd_pub(TOPIC, body))
            sent += 1
        frames.feed(await reader.read(65536))
        for kind, payload in frames.frames():
            if kind == p.FRAME_ERROR:
                raise RuntimeError(payload)
            if payload == b"OK":
                acked += 1
    writer.close()


async def consumer(server, count: int) -> None:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    frames = c.FrameParser()
    writer.write(p.MAGIC_V2 + c.cmd_sub(TOPIC, "ch") + c.cmd_rdy(500))
    done = 0
    while done < count:
        data = await reader.read(1 << 20)
        if not data:
            raise RuntimeError("consumer connection closed")
        frames.feed(data)
        out = []
        for kind, payload in frames.frames():
            if kind == p.FRAME_MESSAGE:
                out.append(c.cmd_fin(payload[10:26]))
            elif payload == b"_heartbeat_":
                out.append(c.cmd_nop())
        done += len(out)
        writer.write(b"".join(out))
    await writer.drain()
    writer.close()


async def throughput(flags: list[str], count: int, base_dir: str | None) -> dict:
    with Server(flags, base_dir) as server:
        server.command(c.cmd_sub(TOPIC, "ch"))  # topic and channel made before timing
        cpu0, t0 = pid_cpu_seconds(server.pid), time.monotonic()
        loop0 = loop_cpu_seconds(server.pid)
        store0 = {pid: pid_cpu_seconds(pid) for pid in server.proc.trace_store_pids()}
        each = count // PUBLISHERS
        await asyncio.gather(consumer(server, each * PUBLISHERS),
                             *(publisher(server, each) for _ in range(PUBLISHERS)))
        wall, cpu = time.monotonic() - t0, pid_cpu_seconds(server.pid) - cpu0
        loop_cpu = loop_cpu_seconds(server.pid) - loop0
        trace = {}
        made = 3 * each * PUBLISHERS if "--trace-all" in flags else 0  # PUB, DELIVER, FIN
        for _ in range(600):  # the writer's backlog (and the batch it holds), after the run
            trace = get(server.proc.http_address, "/stats?format=json")["trace"]
            if trace["buffered"] == 0 and trace["written"] + trace["dropped"] >= made:
                break
            await asyncio.sleep(0.1)
        # the store's child process (trace/process.py, SQLite's or Elasticsearch's; started
        # with the node, as tracing is on), read once it wrote everything
        store_cpu = sum(pid_cpu_seconds(pid) - store0.get(pid, 0.0)
                        for pid in server.proc.trace_store_pids())
        return {"msgs_per_s": each * PUBLISHERS / wall, "cpu_us_per_msg": cpu / count * 1e6,
                "loop_cpu_us_per_msg": loop_cpu / count * 1e6,
                "threads_cpu_us_per_msg": (cpu - loop_cpu) / count * 1e6,
                "store_cpu_us_per_msg": store_cpu / count * 1e6, "trace": trace}


class _Holder:
    __slots__ = ("trace",)

    def __init__(self):
        self.trace = None


def off_hook_ns() -> float:
    """ns of one switched-off hook test (`if h.trace is not None`), loop overhead removed."""
    h = _Holder()
    n = 2_000_000
    test = min(timeit.repeat("if h.trace is not None: pass", globals={"h": h}, number=n,
                             repeat=5))
    empty = min(timeit.repeat("pass", number=n, repeat=5))
    return max(test - empty, 0.0) / n * 1e9


def bench_batches(events: int):
    """Batches of 30,000 events, in time order, as a node writes them: message i published
    at t0 + i µs, delivered 100 ms and finished 200 ms later (PUB, DELIVER, FIN; 4
    partitions; 3 * (events // 3) in all)."""
    now = time.time_ns() - events * 1000
    msgs = events // 3
    lag = 100_000  # messages published in 100 ms
    batch = []
    for j in range(msgs + 2 * lag):
        ts = now + j * 1000
        for i, kind, channel, attempts, who in ((j, "PUB", "", 0, "127.0.0.1:50000"),
                                                (j - lag, "DELIVER", "ch", 1, "127.0.0.1:50001"),
                                                (j - 2 * lag, "FIN", "ch", 1, "")):
            if 0 <= i < msgs:
                batch.append((ts, kind, TOPIC, i % 4, channel, (i % 4) << 50 | i // 4, i,
                              i * 236, attempts, who))
        if len(batch) >= 30_000:
            yield batch
            batch = []
    if batch:
        yield batch


def build_store(path: str, events: int) -> float:
    """A store of bench_batches' events written with the store's own write path; returns
    events written per second."""
    store = TraceStore(path, "bench:4150")
    t0 = time.monotonic()
    for batch in bench_batches(events):
        store.write(batch)
    store.close()
    return 3 * (events // 3) / (time.monotonic() - t0)


# version 2 of the store (a row per event, as trace/store.py wrote it before 46b7274)
V2_SCHEMA = """
CREATE TABLE events (id INTEGER PRIMARY KEY, time_ns INTEGER NOT NULL, node TEXT NOT NULL,
    kind TEXT NOT NULL, topic TEXT NOT NULL, partition INTEGER NOT NULL,
    channel TEXT NOT NULL, msg_id INTEGER NOT NULL, trace_id INTEGER NOT NULL,
    offset INTEGER NOT NULL, attempts INTEGER NOT NULL, detail TEXT NOT NULL);
CREATE INDEX events_msg_id ON events (msg_id);
CREATE INDEX events_trace_id ON events (trace_id) WHERE trace_id != 0;
CREATE TABLE topic_spans (topic TEXT NOT NULL, first_id INTEGER NOT NULL,
    last_id INTEGER NOT NULL, min_time INTEGER NOT NULL, max_time INTEGER NOT NULL);
CREATE INDEX topic_spans_topic ON topic_spans (topic, max_time);
PRAGMA user_version = 2;
"""


def conversion(report: Report, events: int, base_dir: str | None) -> None:
    """A version-2 store of bench_batches' events (a row each, a span per batch), then
    timed: its conversion by the current store's open."""
    tmp = tempfile.mkdtemp(prefix="bench-trace-", dir=base_dir)
    try:
        path = os.path.join(tmp, "trace.sqlite")
        report.note(f"building a version-2 store of {events:,} events ...")
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(V2_SCHEMA)
        first = 1
        for batch in bench_batches(events):
            db.execute("BEGIN")
            db.executemany("INSERT INTO events (time_ns, node, kind, topic, partition, channel, "
                           "msg_id, trace_id, offset, attempts, detail) VALUES "
                           "(?, 'bench:4150', ?, ?, ?, ?, ?, ?, ?, ?, ?)", batch)
            db.execute("INSERT INTO topic_spans VALUES (?, ?, ?, ?, ?)",
                       (TOPIC, first, first + len(batch) - 1, batch[0][0], batch[-1][0]))
            db.execute("COMMIT")
            first += len(batch)
        db.close()
        report.add("v2_file_mb", os.path.getsize(path) / (1 << 20), "the version-2 file (MB)")
        t0, cpu0 = time.monotonic(), time.process_time()
        store = TraceStore(path, "bench:4150")
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        used = store.used_bytes()
        store.close()
        db = sqlite3.connect(path)
        converted = db.execute("SELECT sum(count) FROM chunks").fetchone()[0]
        db.close()
        assert converted == 3 * (events // 3), converted
        report.add("convert_s", wall, "its conversion, wall clock (s)")
        report.add("convert_cpu_us_per_event", cpu / converted * 1e6,
                   "its conversion, CPU per event (us)", fmt=".2f")
        report.add("converted_file_mb", os.path.getsize(path) / (1 << 20),
                   "the file after (MB)")
        report.add("converted_used_mb", used / (1 << 20), "of it in use (MB)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def pub_round_trips(node, seconds: float) -> list[float]:
    """Single PUBs, one at a time, for `seconds`: each one's round trip (ms), sorted."""
    reader, writer = await asyncio.open_connection("127.0.0.1", node.tcp_port)
    frames = c.FrameParser()
    writer.write(p.MAGIC_V2)
    trips = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        writer.write(c.cmd_pub("bench_latency", b"x" * 100))
        answered = False
        while not answered:
            frames.feed(await reader.read(65536))
            for kind, payload in frames.frames():
                if kind == p.FRAME_ERROR:
                    raise RuntimeError(payload)
                answered = answered or payload == b"OK"
        trips.append((time.perf_counter() - started) * 1000)
    writer.close()
    return sorted(trips)


async def search_flood(report: Report, node) -> None:
    """PUB round trips quiet, then while FLOODERS threads search the topic's first 10,000
    events over and over."""
    quiet = await pub_round_trips(node, FLOOD_S)
    stop, took = threading.Event(), []

    def flood() -> None:  # the answer read, not parsed: parsing 4 MB of JSON would hold
        url = f"http://{node.http_address}/trace/search?topic={TOPIC}&limit=10000"
        while not stop.is_set():  # this process's GIL, and delay the PUBs measured here
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=60) as r:
                r.read()
            took.append((time.perf_counter() - started) * 1000)

    flooders = [threading.Thread(target=flood, daemon=True) for _ in range(FLOODERS)]
    for t in flooders:
        t.start()
    await asyncio.sleep(1.0)  # every flooder's first search under way
    flooded = await pub_round_trips(node, FLOOD_S)
    stop.set()
    for t in flooders:
        t.join()
    for name, trips in (("quiet", quiet), ("flood", flooded)):
        what = "no search" if name == "quiet" else f"{FLOODERS} clients flooding searches"
        report.add(f"pub_{name}_count", len(trips), f"PUBs in {FLOOD_S:g} s, {what}", fmt=",")
        for q in (50, 99):
            report.add(f"pub_{name}_p{q}_ms", percentile(trips, q),
                       f"PUB round trip, {what}: p{q} (ms)", fmt=".2f")
        report.add(f"pub_{name}_max_ms", trips[-1], f"PUB round trip, {what}: max (ms)",
                   fmt=".2f")
    took.sort()
    report.add("flood_searches", len(took), "searches of 10,000 events done in the flood", fmt=",")
    report.add("flood_search_p50_ms", percentile(took, 50), "such a search: p50 (ms)", fmt=".0f")


async def search_latency(report: Report, events: int, base_dir: str | None) -> None:
    tmp = tempfile.mkdtemp(prefix="bench-trace-", dir=base_dir)
    try:
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        path = os.path.join(data, "trace.sqlite")
        report.note(f"building a store of {events:,} events ...")
        rate = build_store(path, events)
        report.add("store_build_events_per_s", rate, "store build: events written per second")
        report.add("store_file_mb", os.path.getsize(path) / (1 << 20), "store file (MB)")
        msgs = events // 3
        ids = [(i % 4) << 50 | i // 4 for i in random.Random(7).sample(range(msgs), 1000)]
        direct = []
        for msg_id in ids:
            t0 = time.perf_counter()
            found = search(path, msg_id=msg_id)
            direct.append((time.perf_counter() - t0) * 1000)
            assert len(found) == 3, (msg_id, found)
        direct.sort()
        report.add("search_direct_p50_ms", percentile(direct, 50), "search by id, direct: p50 (ms)",
                   fmt=".3f")
        report.add("search_direct_p99_ms", percentile(direct, 99), "search by id, direct: p99 (ms)",
                   fmt=".3f")
        by_topic = []  # the first 100 events from a random time on (the store's topic spans)
        first_ns = search(path, topic=TOPIC, limit=1)[0]["time_ns"]
        for i in random.Random(8).sample(range(msgs), 200):
            t0 = time.perf_counter()
            found = search(path, topic=TOPIC, since_ns=first_ns + i * 1000, limit=100)
            by_topic.append((time.perf_counter() - t0) * 1000)
            assert len(found) == 100, (i, len(found))
        by_topic.sort()
        report.add("search_topic_p50_ms", percentile(by_topic, 50),
                   "search by topic from a time, 100 events, direct: p50 (ms)", fmt=".3f")
        report.add("search_topic_p99_ms", percentile(by_topic, 99),
                   "search by topic from a time, 100 events, direct: p99 (ms)", fmt=".3f")
        node = _load_servers().NsqdProcess(data, "--log-level", "warning").start()
        try:
            over_http = []
            for msg_id in ids:
                t0 = time.perf_counter()
                got = get(node.http_address, f"/trace/search?msg_id={msg_id:016x}")
                over_http.append((time.perf_counter() - t0) * 1000)
                assert got["count"] == 3, got
            over_http.sort()
            report.add("search_http_p50_ms", percentile(over_http, 50),
                       "search by id over HTTP: p50 (ms)", fmt=".3f")
            report.add("search_http_p99_ms", percentile(over_http, 99),
                       "search by id over HTTP: p99 (ms)", fmt=".3f",
                       target=("< 20", percentile(over_http, 99) < 20))
            report.section("publishing while other clients flood the node with searches")
            await search_flood(report, node)
        finally:
            node.stop(60)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def main_async(args) -> None:
    count = 20_000 if args.quick else 100_000
    events = 1_000_000 if args.quick else 10_000_000
    report = Report("trace")
    report.figures.update(machine_info())
    report.figures.update({"messages": count, "store_events": events, "quick": args.quick})
    report.section(f"publish + consume {count:,} messages ({PUBLISHERS} publishers x "
                   f"{WINDOW} PUBs in flight, 1 consumer), tracing off, on for all "
                   f"(SQLite), on for all (Elasticsearch sink)")
    off = on = es = None
    try:
        sink = OsmemSink().__enter__()
    except ImportError:
        sink = None
        report.note("osmem-server not installed: no Elasticsearch-sink figures")
    losses = []  # each round's own: on against the off run just before it
    for r in range(ROUNDS):  # alternated, the best of each: the machine is shared
        report.note(f"round {r + 1} of {ROUNDS} ...")
        o = await throughput([], count, args.dir)
        t = await throughput(["--trace-all"], count, args.dir)
        losses.append(1 - t["msgs_per_s"] / o["msgs_per_s"])
        off = o if off is None or o["msgs_per_s"] > off["msgs_per_s"] else off
        on = t if on is None or t["msgs_per_s"] > on["msgs_per_s"] else on
        if sink is not None:
            prefix = f"bench-trace-{r}-"
            e = await throughput(["--trace-all", "--trace-es-url", sink.url,
                                  "--trace-es-index-prefix", prefix], count, args.dir)
            sink.drop(prefix)
            es = e if es is None or e["msgs_per_s"] > es["msgs_per_s"] else es
    if sink is not None:
        sink.__exit__()
    report.add("off_msgs_per_s", off["msgs_per_s"], "tracing off: messages per second")
    report.add("on_msgs_per_s", on["msgs_per_s"], "tracing on (SQLite): messages per second")
    loss = 1 - on["msgs_per_s"] / off["msgs_per_s"]
    report.add("on_throughput_loss_share", loss, "throughput lost with tracing on", fmt=".3f",
               target=("<= 0.20", loss <= 0.20))
    report.add("on_round_losses", [round(x, 3) for x in losses],
               "each round's loss (on against the off run just before it)")
    report.add("on_round_loss_median", statistics.median(losses),
               "the median of the rounds' losses", fmt=".3f")
    report.add("off_cpu_us_per_msg", off["cpu_us_per_msg"], "tracing off: nsqd CPU per message (us)")
    report.add("on_cpu_us_per_msg", on["cpu_us_per_msg"], "tracing on: nsqd CPU per message (us)")
    report.add("off_loop_cpu_us_per_msg", off["loop_cpu_us_per_msg"],
               "tracing off: event loop CPU per message (us)")
    report.add("on_loop_cpu_us_per_msg", on["loop_cpu_us_per_msg"],
               "tracing on: event loop CPU per message (us)")
    report.add("on_threads_cpu_us_per_msg", on["threads_cpu_us_per_msg"],
               "tracing on: other threads' CPU per message (us)")
    report.add("off_threads_cpu_us_per_msg", off["threads_cpu_us_per_msg"],
               "tracing off: other threads' CPU per message (us)")
    report.add("on_store_cpu_us_per_msg", on["store_cpu_us_per_msg"],
               "tracing on: the SQLite store process's CPU per message (us)")
    t = on["trace"]
    report.add("on_events_written", t["written"], "tracing on: events written", fmt=",")
    report.add("on_events_dropped", t["dropped"], "tracing on: events dropped (buffer bound)",
               fmt=",")
    if es is not None:
        report.add("es_msgs_per_s", es["msgs_per_s"],
                   "tracing on (Elasticsearch sink, osmem-server): messages per second")
        report.add("es_throughput_loss_share", 1 - es["msgs_per_s"] / off["msgs_per_s"],
                   "throughput lost with the Elasticsearch sink", fmt=".3f")
        report.add("es_cpu_us_per_msg", es["cpu_us_per_msg"],
                   "Elasticsearch sink: nsqd CPU per message (us)")
        report.add("es_loop_cpu_us_per_msg", es["loop_cpu_us_per_msg"],
                   "Elasticsearch sink: event loop CPU per message (us)")
        report.add("es_store_cpu_us_per_msg", es["store_cpu_us_per_msg"],
                   "Elasticsearch sink: its store process's CPU per message (us)")
        report.add("es_events_written", es["trace"]["written"],
                   "Elasticsearch sink: events written", fmt=",")
        report.add("es_events_dropped", es["trace"]["dropped"],
                   "Elasticsearch sink: events dropped (buffer bound)", fmt=",")
    report.section("the switched-off hook")
    hook = off_hook_ns()
    report.add("off_hook_ns", hook, "one `trace is not None` test (ns)", fmt=".1f")
    share = 4 * hook / 1000 / off["cpu_us_per_msg"]  # publish, deliver, finish (+ timeouts)
    report.add("off_hooks_share_of_msg_cpu", share, "4 such tests per message, share of its CPU",
               fmt=".5f", target=("< 0.02", share < 0.02))
    report.section(f"search by message id in a store of {events:,} events")
    await search_latency(report, events, args.dir)
    report.section(f"converting a version-2 store (a row per event) of {events:,} events")
    conversion(report, events, args.dir)
    report.emit_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="20,000 messages and a store of 1 million events")
    parser.add_argument("--dir", help="temporary folders inside this folder (default /tmp)")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
