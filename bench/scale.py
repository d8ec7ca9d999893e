"""How one nsqd's cost grows with its partitions (issue 31, "Scale").

    .venv/bin/python bench/scale.py [--quick] [--sizes 100,1000,10000] [--nsqd-root DIR]

For each N (100, 1,000, 10,000; `--quick`: 100 and 1,000), a fresh single nsqd (no etcd,
R=1, default durable settings) in a temporary folder, holding N partitions in all: topics
of at most 1,000 partitions, one channel each, one 200-byte message in every partition
(pipelined TCP `PUB topic partition` over 4 connections, every answer checked). Then:

- setup: the time to create the topics and channels and to publish (informational);
- idle CPU: nsqd's CPU time (all threads) over 10 s with nothing happening, 2 s after
  the setup, as % of one core (target < 2%), and its event loop's thread's part;
- then RSS (VmRSS of the nsqd process), its threads and open file descriptors;
- `GET /stats?format=json` and `GET /metrics`: median time of 5, and their sizes; meanwhile
  one connection PUBs one message at a time, and its longest round trip is printed beside
  the longest of the same PUBs alone for READ_S before (what a read of every partition
  costs the publishers: the loop's longest stall);
- restart: SIGKILL, then started again: the time until it serves HTTP (/ping answers)
  and until it serves every partition: /stats lists each with `"error": null` and the
  channel, and a PUB to the last partition of each topic answers OK (target < 10 s);
  median of 3 restarts;
- idle CPU, RSS, threads and descriptors again after the last restart.

Then each figure's growth: N=1,000 over N=100 and N=10,000 over N=1,000; a ratio above
1.2 times N's own (12 for 10x the partitions) is called faster than linear. A step that
fails (the node cannot start, runs out of descriptors, a deadline passes: 0.03 s a
partition, at least 60 s: 300 s at N=10,000) is recorded as `failed_<N>` with the step it reached and the node's threads,
descriptors, RSS and serving partitions then, and the bench goes on with the next N.

`--nsqd-root DIR` runs the nsqd of another checkout (as bench/nsqd.py's), for before/after
pairs.

Each partition holds a log's files open, so the bench raises its RLIMIT_NOFILE soft
limit to the hard limit before starting nsqd (a child inherits it); both are printed.

Prints readable lines, then ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
if ROOT not in sys.path:
    sys.path.append(ROOT)
from bench import common  # noqa: E402
from bench.common import Report  # noqa: E402
from bench import nsqd_server  # noqa: E402
from bench.nsqd_server import _load_servers, pid_cpu_seconds, pid_rss_mb, thread_cpu  # noqa: E402
from nsqwire import protocol as p  # noqa: E402
from nsqwire.commands import FrameParser, cmd_pub  # noqa: E402

BODY = b"x" * 200
TOPIC_PARTITIONS = 1000  # the most partitions a topic here (nsqd allows 1,024)
CONNS = 4
DEPTH = 500  # PUBs in flight a connection
RESTARTS = 3
IDLE_S = 10.0
SETTLE_S = 2.0
READ_S = 3.0  # PUBs one at a time alone, before the same beside /stats and /metrics
FASTER_THAN_LINEAR = 1.2  # a ratio above 1.2x N's own is faster than linear
FIGURES = [  # (key, label, format)
    ("setup_s", "setup: topics, channels, publish (s)", ".2f"),
    ("idle_cpu_pct", "idle CPU (% of a core)", ".2f"),
    ("idle_loop_cpu_pct", "idle CPU, the event loop thread (%)", ".2f"),
    ("rss_mb", "RSS (MB)", ".1f"),
    ("threads", "threads", ",d"),
    ("fds", "open file descriptors", ",d"),
    ("stats_ms", "/stats?format=json (ms, median of 5)", ",.1f"),
    ("stats_bytes", "/stats?format=json size (bytes)", ",d"),
    ("metrics_ms", "/metrics (ms, median of 5)", ",.1f"),
    ("metrics_bytes", "/metrics size (bytes)", ",d"),
    ("pub_alone_longest_ms", "one PUB at a time, nothing else: longest (ms)", ",.1f"),
    ("pub_beside_reads_longest_ms", "one PUB at a time beside the reads: longest (ms)", ",.1f"),
    ("restart_http_s", "restart: to serving HTTP (s, median of 3)", ".2f"),
    ("restart_serving_s", "restart: to every partition (s, median of 3)", ".2f"),
    ("restart_idle_cpu_pct", "after the restart: idle CPU (% of a core)", ".2f"),
    ("restart_idle_loop_cpu_pct", "after the restart: idle CPU, loop thread (%)", ".2f"),
    ("restart_rss_mb", "after the restart: RSS (MB)", ".1f"),
    ("restart_threads", "after the restart: threads", ",d"),
    ("restart_fds", "after the restart: open file descriptors", ",d"),
]


class Deadline:
    """Every wait of one N's run is bounded by one deadline."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        return left


def _request(proc, method: str, path: str, deadline: Deadline) -> bytes:
    """The body of a 200 answer from nsqd's HTTP API; anything else raises."""
    req = urllib.request.Request(f"http://{proc.http_address}{path}", method=method)
    try:
        with urllib.request.urlopen(req, timeout=deadline.left()) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{method} {path}: {e.code} {e.read()[:200]!r}") from None


def _topics(n: int) -> dict[str, int]:
    """Topic name -> its partition count, n partitions in all."""
    return {f"scale{i}": min(TOPIC_PARTITIONS, n - i * TOPIC_PARTITIONS)
            for i in range(-(-n // TOPIC_PARTITIONS))}


async def _publish(tcp_address: str, pubs: list[tuple[str, int]], deadline: Deadline) -> None:
    """One PUB for each (topic, partition), over CONNS connections with DEPTH in flight
    each; every answer must be OK."""
    async def one(share: list[tuple[str, int]]) -> None:
        host, port = tcp_address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(p.MAGIC_V2)
        frames = FrameParser()
        try:
            for i in range(0, len(share), DEPTH):
                batch = share[i:i + DEPTH]
                writer.write(b"".join(cmd_pub(t, BODY, n) for t, n in batch))
                got = 0
                while got < len(batch):
                    chunk = await reader.read(1 << 16)
                    if not chunk:
                        raise RuntimeError(f"nsqd closed the connection after {got} answers")
                    frames.feed(chunk)
                    for kind, data in frames.frames():
                        if kind == p.FRAME_ERROR:
                            raise RuntimeError(f"PUB answered {data.decode()}")
                        if kind == p.FRAME_RESPONSE and data == b"OK":
                            got += 1
        finally:
            writer.close()

    async with asyncio.timeout(deadline.left()):
        await asyncio.gather(*(one(pubs[i::CONNS]) for i in range(CONNS)))


async def _reads_beside_a_publisher(proc, topic: str, deadline: Deadline) -> dict:
    """One connection PUBs to `topic` one at a time: alone for READ_S, then while
    /stats?format=json and /metrics are each read 5 times (from a thread). Returns each
    path's (times, last body) and the PUBs' round trips: "alone" and "beside" the reads."""
    host, port = proc.tcp_address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(p.MAGIC_V2)
    frames = FrameParser()

    async def publish(done) -> list[float]:
        trips = []
        while not done():
            t = time.perf_counter()
            writer.write(cmd_pub(topic, BODY))
            answers: list = []
            while not answers:
                frames.feed(await asyncio.wait_for(reader.read(1 << 16), deadline.left()))
                answers = list(frames.frames())
            if answers != [(p.FRAME_RESPONSE, b"OK")]:
                raise RuntimeError(f"PUB answered {answers}")
            trips.append(time.perf_counter() - t)
        return trips

    out: dict = {}
    try:
        end = time.monotonic() + READ_S
        out["alone"] = await publish(lambda: time.monotonic() > end)
        reading = True
        beside = asyncio.ensure_future(publish(lambda: not reading))
        for path in ("/stats?format=json", "/metrics"):
            times = []
            for _ in range(5):
                t = time.perf_counter()
                body = await asyncio.to_thread(_request, proc, "GET", path, deadline)
                times.append(time.perf_counter() - t)
            out[path] = (times, body)
        reading = False
        out["beside"] = await beside
    finally:
        writer.close()
    return out


def _counts(pid: int) -> tuple[int, int]:
    """(threads, open file descriptors) of a process."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def _idle_cpu_pct(pid: int) -> tuple[float, float]:
    """nsqd's CPU over IDLE_S, % of one core: all threads, and its event loop's thread."""
    time.sleep(SETTLE_S)
    cpu, loop, t = pid_cpu_seconds(pid), _loop_cpu(pid), time.monotonic()
    time.sleep(IDLE_S)
    wall = time.monotonic() - t
    return (pid_cpu_seconds(pid) - cpu) / wall * 100, (_loop_cpu(pid) - loop) / wall * 100


def _loop_cpu(pid: int) -> float:
    c = thread_cpu(pid)
    return c["loop_user"] + c["loop_sys"]


def _all_serving(proc, topics: dict[str, int], deadline: Deadline) -> bool:
    """Whether /stats lists every partition with no error and the channel, and a PUB to
    each topic's last partition answers OK."""
    try:
        stats = json.loads(_request(proc, "GET", "/stats?format=json", deadline))
    except (OSError, RuntimeError):
        return False
    listed = {t["topic_name"]: t["partitions"] for t in stats["topics"]}
    for name, count in topics.items():
        parts = listed.get(name, [])
        if len(parts) != count or any(x["error"] is not None or x["channels"] != ["c"]
                                      for x in parts):
            return False
    try:
        asyncio.run(_publish(proc.tcp_address, [(t, n - 1) for t, n in topics.items()],
                             deadline))
    except (OSError, RuntimeError):
        return False
    return True


def _at_failure(report: Report, proc, n: int) -> None:
    """How far a failed run got: nsqd's threads, descriptors and RSS, the partitions its
    /stats lists as serving, and its log's last lines."""
    if proc.proc is not None and proc.proc.poll() is None:
        pid = proc.proc.pid
        threads, fds = _counts(pid)
        report.add(f"failed_threads_{n}", threads, "at the failure: threads", fmt=",d")
        report.add(f"failed_fds_{n}", fds, "at the failure: open file descriptors", fmt=",d")
        report.add(f"failed_rss_mb_{n}", pid_rss_mb(pid), "at the failure: RSS (MB)")
        try:
            stats = json.loads(_request(proc, "GET", "/stats?format=json", Deadline(30)))
            parts = [x for t in stats["topics"] for x in t["partitions"]]
            report.add(f"failed_serving_partitions_{n}", sum(x["error"] is None for x in parts),
                       "at the failure: partitions serving (/stats)", fmt=",d")
        except (OSError, RuntimeError, ValueError) as e:
            report.note(f"/stats at the failure: {type(e).__name__}: {e}")
    else:
        report.note("nsqd is not running")
    log = proc.log().strip().splitlines()
    if log:
        report.note("nsqd's log ends: " + " | ".join(log[-3:])[-1500:])


def run(report: Report, servers, n: int, base_dir: str | None) -> None:
    """Every figure of one N into `report` as `<key>_<n>`; a failure as `failed_<n>`."""
    topics = _topics(n)
    deadline = Deadline(max(60, n * 0.03))
    report.section(f"N={n:,}: {len(topics)} topic(s) of {max(topics.values()):,} "
                   "partitions, one channel each, one message a partition")
    step = "start"

    def add(key: str, value) -> None:
        label, fmt = next((lab, f) for k, lab, f in FIGURES if k == key)
        target = None
        if key in ("idle_cpu_pct", "restart_idle_cpu_pct"):
            target = ("< 2", value < 2)
        elif key == "restart_serving_s":
            target = ("< 10", value < 10)
        report.add(f"{key}_{n}", value, label, fmt=fmt, target=target)

    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=base_dir) as tmp:
        proc = servers.NsqdProcess(os.path.join(tmp, "nsqd"))
        try:
            proc.start(timeout=deadline.left())
            pid = proc.proc.pid
            t = time.perf_counter()
            for i, (name, count) in enumerate(topics.items()):
                step = f"create topics and channels ({i} of {len(topics)} made)"
                _request(proc, "POST", f"/topic/create?topic={name}&partition_num={count}",
                         deadline)
                _request(proc, "POST", f"/channel/create?topic={name}&channel=c", deadline)
            created = time.perf_counter() - t
            step = "publish"
            asyncio.run(_publish(proc.tcp_address, [(name, i) for name, count in topics.items()
                                                    for i in range(count)], deadline))
            add("setup_s", time.perf_counter() - t)
            report.note(f"of which creating: {created:.2f} s")
            step = "measure"
            idle, loop = _idle_cpu_pct(pid)
            add("idle_cpu_pct", idle)
            add("idle_loop_cpu_pct", loop)
            threads, fds = _counts(pid)
            add("rss_mb", pid_rss_mb(pid))
            add("threads", threads)
            add("fds", fds)
            step = "stats"
            read = asyncio.run(_reads_beside_a_publisher(proc, next(iter(topics)), deadline))
            for path, key in (("/stats?format=json", "stats"), ("/metrics", "metrics")):
                times, body = read[path]
                add(f"{key}_ms", statistics.median(times) * 1000)
                add(f"{key}_bytes", len(body))
            add("pub_alone_longest_ms", max(read["alone"]) * 1000)
            add("pub_beside_reads_longest_ms", max(read["beside"]) * 1000)
            to_http, to_all = [], []
            for i in range(RESTARTS):
                step = f"restart {i + 1}"
                proc.kill()
                t = time.perf_counter()
                proc.start(timeout=deadline.left())
                to_http.append(time.perf_counter() - t)
                while not _all_serving(proc, topics, deadline):
                    deadline.left()
                    time.sleep(0.05)
                to_all.append(time.perf_counter() - t)
            add("restart_http_s", statistics.median(to_http))
            add("restart_serving_s", statistics.median(to_all))
            report.note("each restart, to HTTP / to every partition (s): " + ", ".join(
                f"{a:.2f} / {b:.2f}" for a, b in zip(to_http, to_all)))
            step = "measure after the restart"
            pid = proc.proc.pid
            idle, loop = _idle_cpu_pct(pid)
            add("restart_idle_cpu_pct", idle)
            add("restart_idle_loop_cpu_pct", loop)
            threads, fds = _counts(pid)
            add("restart_rss_mb", pid_rss_mb(pid))
            add("restart_threads", threads)
            add("restart_fds", fds)
        except Exception as e:
            report.add(f"failed_{n}", f"{step}: {type(e).__name__}: {e}", "FAILED", fmt="")
            report.check(f"N={n} measured to the end", False)
            _at_failure(report, proc, n)
        finally:
            proc.kill()


def growth(report: Report, sizes: list[int]) -> None:
    """Each figure's ratio between consecutive sizes; which grow faster than linear."""
    report.section("growth: a figure at N over the same at the size before; faster than "
                   f"linear when above {FASTER_THAN_LINEAR:g}x N's own ratio")
    faster = []
    for key, label, _ in FIGURES:
        ratios = []
        for a, b in zip(sizes, sizes[1:]):
            va, vb = report.figures.get(f"{key}_{a}"), report.figures.get(f"{key}_{b}")
            if not va or vb is None:  # failed, or 0 (idle CPU under a clock tick)
                continue
            ratio = vb / va
            name = f"{key}_ratio_{b}_to_{a}"
            report.figures[name] = round(ratio, 3)
            ratios.append(f"{b:,}/{a:,} x{ratio:.2f}")
            if ratio > FASTER_THAN_LINEAR * b / a:
                faster.append(name)
        if ratios:
            print(f"   {label:<48} {', '.join(ratios)}", flush=True)
    report.figures["faster_than_linear"] = faster
    report.note("faster than linear: " + (", ".join(faster) or "none"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N = 100 and 1,000 only")
    ap.add_argument("--sizes", help="comma-separated partition counts (default 100,1000,10000)")
    ap.add_argument("--dir", help="make the temporary folders in this one (default /tmp)")
    ap.add_argument("--nsqd-root", metavar="DIR",
                    help="run the nsqd of the checkout in DIR, for before/after pairs")
    args = ap.parse_args()
    if args.nsqd_root:
        nsqd_server.ROOT = os.path.abspath(args.nsqd_root)  # _load_servers loads its servers.py
    sizes = ([int(x) for x in args.sizes.split(",")] if args.sizes
             else [100, 1000] if args.quick else [100, 1000, 10_000])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    servers = _load_servers()
    report = Report("scale")
    report.figures.update(common.machine_info())
    report.figures["nofile_limit"] = hard
    report.figures["nsqd_root"] = nsqd_server.ROOT
    report.note(f"RLIMIT_NOFILE for nsqd: {hard:,} (was {soft:,} soft, {hard:,} hard)")
    for n in sizes:
        run(report, servers, n, args.dir)
    growth(report, sizes)
    report.figures["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
