"""nsqd end-to-end benchmark: our nsqd in a subprocess, driven by load-generator processes.

    .venv/bin/python bench/nsqd.py [--quick]
    .venv/bin/python bench/nsqd.py --only a,c --configs durable --py-spy /tmp/prof   # profile the server
    .venv/bin/python bench/nsqd.py | tail -1 | jq .                                    # just the figures

Every scenario gets a fresh nsqd (tests/servers.py NsqdProcess) on a fresh temporary data
path. The clients are separate processes (multiprocessing, spawn) running uvloop and a
tight asyncio.Protocol per connection (raw frames, FINs batched into one write per read),
so their Python CPU is not the server's. The machine may have only 2 CPUs: server and
clients share them; each part prints the CPUs the server, the clients and other processes
used. Messages have 200-byte bodies.

  (a) pub1:       100 producer connections, one PUB at a time each (wait for OK): msgs/s, p50/p99
  (b) mpub200:    4 connections, MPUB of 200 messages at a time each (wait for OK): msgs/s, MB/s
  (c) consume1:   publish a 1,000,000-message backlog with MPUB, then 4 consumers of one
                  channel at RDY 200 drain it (all received and FIN'd): msgs/s
  (d) channels20: the same backlog on a topic with 20 channels (created before publishing),
                  --channel-consumers consumers per channel at RDY 200, for a bounded time:
                  total msgs/s over the 20 channels, and its ratio to (c)
  (e) mpub200x2:  MPUB 200 x 200 B on 2 connections, one request in flight each (Go's
                  bench_writer): msgs/s, p50/p99: the round trip of one durable batch
  (f) pubconns:   one PUB at a time on 1, 10 and 100 connections: p50/p99 and msgs/s
  (g) isolation:  16 topics at once (100 connections spread over them, one PUB at a time
                  each; `--topics 16,100,1000` for several spreads, a connection taking
                  several topics in turn): total msgs/s, its ratio to one topic's, and
                  their server CPU per message's ratio; then a light topic (1 connection,
                  one PUB at a time) beside a saturated one (100 connections): its p99
  (h) pipelined:  4 connections, each sending 32 PUBs together and the next 32 once all are
                  answered (as a client with many publishers on one connection): msgs/s and
                  the server's CPU per message (their answers leave in one write per turn)
  (i) named:      what idempotent producers cost: (a)'s load and (e)'s as PUB_EXT / MPUB_EXT,
                  each request named (a producer id per connection, the next sequence) against
                  the same commands unnamed, on a fresh nsqd each, alternated for --rounds
                  rounds: medians of msgs/s, server CPU per message and p99, and their ratios
and all of it twice: nsqd's defaults (durable: every batch synced before OK), then
`--sync-every 10000`. Every part gives the server's CPU per message (`*_server_cpu_us_per_msg`,
from /proc/PID/stat of the server over the measured span). Prints readable lines, then ONE
line of JSON with every figure. `--nsqd-root DIR` runs the nsqd of another checkout (a git
worktree of the previous commit): run both, back to back, for before/after pairs.
"""

from __future__ import annotations

import argparse
import array
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# This file is bench/nsqd.py: with bench/ on sys.path, `import nsqd` would import this
# script itself. Drop bench/ and import the bench modules as `bench.*` from the repository
# root, appended (never shadowing the standard library). The load generators' spawn
# children inherit this sys.path, and so import `bench.loadgen` the same way.
sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
if ROOT not in sys.path:
    sys.path.append(ROOT)
from bench import common  # noqa: E402
from bench.common import MB, Report, percentile  # noqa: E402
from bench.loadgen import Workers, cpu_seconds  # noqa: E402
from bench import nsqd_server  # noqa: E402
from bench.nsqd_server import (Profiler, Server, pid_cpu_seconds, summarize_profile,  # noqa: E402
                               thread_cpu)
from nsqwire.commands import cmd_mpub, cmd_mpub_ext, cmd_pub, cmd_pub_ext  # noqa: E402

BODY_LEN = 200
TOPIC = "bench"
MPUB_BATCH = 200
RDY = 200

FULL = dict(pub_conns=100, pub_warm_s=1.0, pub_s=10.0, mpub_conns=4, mpub_warm_s=1.0,
            mpub_s=10.0, backlog=1_000_000, backlog_conns=4, consumers=4, channels=20,
            channels_max_s=25.0, fsync_s=1.0, conns_s=5.0)
QUICK = dict(pub_conns=100, pub_warm_s=0.5, pub_s=3.0, mpub_conns=4, mpub_warm_s=0.5,
             mpub_s=3.0, backlog=100_000, backlog_conns=4, consumers=4, channels=20,
             channels_max_s=5.0, fsync_s=0.5, conns_s=2.0)

CONFIGS = {"durable": [], "sync10000": ["--sync-every", "10000"],
           "threads": ["--journal", "false"]}  # durable, a write thread and a sync a partition

TARGET_PUB1_MSGS = 30_000
TARGET_PUB1_P99_MS = 10.0
TARGET_MPUB_MSGS = 250_000
TARGET_CONSUME_MSGS = 150_000
TARGET_CHANNELS_RATIO = 0.8

GO_REFERENCE = [  # Go nsqd v1.3.0, its own bench tools, 200-byte messages, this kind of machine
    ("go_mpub200_msgs_per_s_low", 160_000, "MPUB batches of 200 (default flags, no sync before ack): low"),
    ("go_mpub200_msgs_per_s_median", 173_000, "MPUB batches of 200: median"),
    ("go_mpub200_msgs_per_s_high", 290_000, "MPUB batches of 200: high"),
    ("go_pub1_msgs_per_s", 31_000, "one message per request"),
    ("go_pub1_sync1_msgs_per_s_low", 400, "--mem-queue-size=0 --sync-every=1: low"),
    ("go_pub1_sync1_msgs_per_s_high", 730, "--mem-queue-size=0 --sync-every=1: high"),
    ("go_consume_disk_msgs_per_s_low", 130_000, "consuming a backlog on disk: low"),
    ("go_consume_disk_msgs_per_s_high", 170_000, "consuming a backlog on disk: high"),
]


# =============================================================================
# Running one measured phase
# =============================================================================

class Phase:
    """A measured span: wall time, CPUs used by the server, the clients and other processes."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.server0 = pid_cpu_seconds(self.pid)
        self.threads0 = thread_cpu(self.pid)
        self.sys0 = common._system_busy_seconds()
        self.self0 = cpu_seconds()

    def stop(self, client_cpu_s: float) -> None:
        self.wall = max(time.monotonic() - self.t0, 1e-9)
        self.server_cpus = (pid_cpu_seconds(self.pid) - self.server0) / self.wall
        threads1 = thread_cpu(self.pid)
        self.threads = {k: v - self.threads0[k] for k, v in threads1.items()}  # over the span
        self.client_cpus = client_cpu_s / self.wall
        own = (cpu_seconds() - self.self0) / self.wall
        sys1 = common._system_busy_seconds()
        if self.sys0 is None or sys1 is None:
            self.other_cpus = float("nan")
        else:
            used = (sys1 - self.sys0) / self.wall
            self.other_cpus = max(0.0, used - self.server_cpus - self.client_cpus - own)


def run_load(server: Server, specs: list[dict], profile: str | None, rate: int,
             native: bool = False):
    """Start load generators, go, collect. Returns (results, t0, phase)."""
    for s in specs:
        s["host"], s["port"] = server.host, server.port
    workers = Workers(specs)
    try:
        workers.start()
        prof = Profiler(server.pid, profile, rate, native)
        phase = Phase(server.pid)
        phase.start()
        t0 = time.monotonic() + 0.05
        workers.go(t0)
        try:
            results = workers.results()
        finally:
            prof.stop()
        phase.stop(sum(r["cpu_s"] for r in results))
    finally:
        workers.close()
    for r in results:
        if r["n_errors"]:
            print(f"   !! {r['n_errors']} errors in a load generator, e.g. {r['errors']}", flush=True)
    return results, t0, phase


def split(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def produce_specs(cmd: bytes, per_cmd: int, conns: int, procs: int, *, warm_s=None, dur_s=None,
                  batches: int = 0) -> list[dict]:
    specs = []
    per_proc = [c for c in split(conns, procs) if c]
    batch_split = split(batches, conns) if batches else None
    i = 0
    for k in per_proc:
        spec = {"kind": "produce", "cmd": cmd, "per_cmd": per_cmd, "conns": k,
                "timeout_s": 600}
        if dur_s is not None:
            spec.update(warm_s=warm_s, dur_s=dur_s, timeout_s=warm_s + dur_s + 60)
        else:
            spec["batches"] = batch_split[i:i + k]
        i += k
        specs.append(spec)
    return specs


def cpu_note(report: Report, key: str, phase: Phase, clients: str, rate: float) -> None:
    """CPUs used by server, clients and others; and msgs per server CPU-second, the figure
    least moved by other processes taking CPU away (while the server stays CPU-bound)."""
    if phase.server_cpus > 0:
        report.add(f"{key}_msgs_per_server_cpu_s", rate / phase.server_cpus,
                   "msgs per server CPU-second", fmt=",.0f")
        report.add(f"{key}_server_cpu_us_per_msg", phase.server_cpus / rate * 1e6,
                   "server CPU per message (µs)", fmt=",.2f")
        msgs = rate * phase.wall
        split = {k: v / msgs * (1 if k.endswith("switches") else 1e6)
                 for k, v in phase.threads.items()}
        for k, v in split.items():
            report.figures[f"{key}_server_{k}_per_msg"] = round(v, 2)
        report.note(f"server CPU per message (µs): event loop {split['loop_user']:.1f} user + "
                    f"{split['loop_sys']:.1f} system, other threads {split['threads_user']:.1f} "
                    f"+ {split['threads_sys']:.1f}; their waits (voluntary switches) "
                    f"{split['threads_switches']:.2f} a message  [{key}_server_*_per_msg]")
    report.figures[f"{key}_server_cpus"] = round(phase.server_cpus, 2)
    report.figures[f"{key}_client_cpus"] = round(phase.client_cpus, 2)
    report.figures[f"{key}_other_cpus"] = round(phase.other_cpus, 2)
    report.note(f"CPUs used: server {phase.server_cpus:.2f}, clients {phase.client_cpus:.2f} "
                f"({clients}), other processes {phase.other_cpus:.2f}  "
                f"[{key}_server_cpus, _client_cpus, _other_cpus]")


def rss_note(report: Report, key: str, server: Server) -> None:
    report.add(f"{key}_rss_peak_mb", server.rss_peak_mb, "server RSS peak (VmRSS, every 100 ms)",
               fmt=",.1f")


def profile_path(args, cfg: str, part: str) -> str | None:
    if not args.py_spy:
        return None
    os.makedirs(args.py_spy, exist_ok=True)
    return os.path.join(args.py_spy, f"{cfg}_{part}.txt")


def print_profile(report: Report, path: str | None) -> None:
    if path:
        report.note(f"py-spy profile of the server: {path}")
        for line in summarize_profile(path):
            report.note("  " + line)


# =============================================================================
# Scenarios
# =============================================================================

def fsync_bound(base_dir: str | None, seconds: float) -> float:
    """write(236 bytes) + fdatasync per second, one writer: what the disk allows right now
    (a noise indicator: other processes' I/O slows it)."""
    fd, path = tempfile.mkstemp(prefix="bench-nsqd-fsync-", dir=base_dir)
    try:
        rec = os.urandom(236)
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            os.write(fd, rec)
            os.fdatasync(fd)
            n += 1
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)


def bodies(n: int) -> list[bytes]:
    return [os.urandom(BODY_LEN // 2).hex().encode() for _ in range(n)]


def part_pub1(report: Report, cfg: str, flags: list[str], P: dict, args) -> None:
    key = f"{cfg}_pub1"
    report.section(f"[{cfg}] (a) {P['pub_conns']} producers, one {BODY_LEN}-byte PUB at a time "
                   f"each ({P['pub_warm_s']:g} s warm-up, {P['pub_s']:g} s measured)")
    with Server(flags, args.dir) as srv:
        srv.command(cmd_pub(TOPIC, b"x" * BODY_LEN))  # the topic exists before the clock starts
        specs = produce_specs(cmd_pub(TOPIC, bodies(1)[0]), 1, P["pub_conns"], args.procs,
                              warm_s=P["pub_warm_s"], dur_s=P["pub_s"])
        prof = profile_path(args, cfg, "pub1")
        results, _, phase = run_load(srv, specs, prof, args.py_spy_rate, args.py_spy_native)
        count = sum(r["count"] for r in results)
        lat = array.array("d")
        for r in results:
            lat.frombytes(r["lat"])
        lat = sorted(lat)
        rate = count / P["pub_s"]
        p50 = percentile(lat, 50) * 1000
        p99 = percentile(lat, 99) * 1000
        report.add(f"{key}_msgs_per_s", rate, "PUB msgs/s", fmt=",.0f",
                   target=(f">= {TARGET_PUB1_MSGS:,}", rate >= TARGET_PUB1_MSGS))
        report.add(f"{key}_p50_ms", p50, "PUB latency p50 (ms)", fmt=",.2f")
        report.add(f"{key}_p99_ms", p99, "PUB latency p99 (ms)", fmt=",.2f",
                   target=(f"< {TARGET_PUB1_P99_MS:g}", p99 < TARGET_PUB1_P99_MS))
        report.add(f"{key}_max_ms", (lat[-1] if lat else float("nan")) * 1000,
                   "PUB latency max (ms)", fmt=",.2f")
        report.figures[f"{key}_msgs"] = count
        report.figures[f"{key}_connections"] = P["pub_conns"]
        rss_note(report, key, srv)
        cpu_note(report, key, phase, f"{len(specs)} process(es), {P['pub_conns']} connections",
                 rate)
    print_profile(report, prof)


def part_mpub(report: Report, cfg: str, flags: list[str], P: dict, args) -> None:
    key = f"{cfg}_mpub200"
    report.section(f"[{cfg}] (b) {P['mpub_conns']} connections, MPUB of {MPUB_BATCH} x "
                   f"{BODY_LEN} bytes at a time each ({P['mpub_warm_s']:g} s warm-up, "
                   f"{P['mpub_s']:g} s measured)")
    with Server(flags, args.dir) as srv:
        srv.command(cmd_pub(TOPIC, b"x" * BODY_LEN))
        specs = produce_specs(cmd_mpub(TOPIC, bodies(MPUB_BATCH)), MPUB_BATCH,
                              P["mpub_conns"], min(args.procs, P["mpub_conns"]),
                              warm_s=P["mpub_warm_s"], dur_s=P["mpub_s"])
        prof = profile_path(args, cfg, "mpub200")
        results, _, phase = run_load(srv, specs, prof, args.py_spy_rate, args.py_spy_native)
        count = sum(r["count"] for r in results)
        lat = array.array("d")
        for r in results:
            lat.frombytes(r["lat"])
        lat = sorted(lat)
        rate = count / P["mpub_s"]
        report.add(f"{key}_msgs_per_s", rate, "MPUB msgs/s", fmt=",.0f",
                   target=(f">= {TARGET_MPUB_MSGS:,}", rate >= TARGET_MPUB_MSGS))
        report.add(f"{key}_mb_per_s", rate * BODY_LEN / MB, "MPUB MB/s (message bodies)",
                   fmt=",.1f")
        report.add(f"{key}_p50_ms", percentile(lat, 50) * 1000, "MPUB latency p50 (ms)", fmt=",.2f")
        report.add(f"{key}_p99_ms", percentile(lat, 99) * 1000, "MPUB latency p99 (ms)", fmt=",.2f")
        report.figures[f"{key}_msgs"] = count
        report.figures[f"{key}_connections"] = P["mpub_conns"]
        rss_note(report, key, srv)
        cpu_note(report, key, phase, f"{len(specs)} process(es), {P['mpub_conns']} connections",
                 rate)
    print_profile(report, prof)


def publish_backlog(report: Report, srv: Server, key: str, P: dict, args) -> None:
    n = P["backlog"]
    specs = produce_specs(cmd_mpub(TOPIC, bodies(MPUB_BATCH)), MPUB_BATCH, P["backlog_conns"],
                          min(args.procs, P["backlog_conns"]), batches=n // MPUB_BATCH)
    results, t0, phase = run_load(srv, specs, None, 0)
    count = sum(r["count"] for r in results)
    if count != n:
        raise RuntimeError(f"backlog: published {count} of {n}")
    elapsed = max(r["t_last"] for r in results) - t0
    report.add(f"{key}_backlog_publish_msgs_per_s", count / elapsed,
               f"backlog of {n:,}: MPUB msgs/s (informational)", fmt=",.0f")


def consume(srv: Server, groups: list[tuple[str, int]], expected: int, procs: int,
            max_s: float | None, profile: str | None, rate: int, native: bool = False):
    """Consumers by channel group, groups spread over `procs` processes."""
    specs = []
    per_proc = [k for k in split(len(groups), procs) if k]
    i = 0
    for k in per_proc:
        specs.append({"kind": "consume", "topic": TOPIC, "groups": groups[i:i + k],
                      "expected": expected, "rdy": RDY, "max_s": max_s,
                      "timeout_s": (max_s or 300) + 120})
        i += k
    results, t0, phase = run_load(srv, specs, profile, rate, native)
    gs = [g for r in results for g in r["groups"]]
    return gs, t0, phase, len(specs)


def part_consume1(report: Report, cfg: str, flags: list[str], P: dict, args) -> float:
    key = f"{cfg}_consume1"
    n = P["backlog"]
    report.section(f"[{cfg}] (c) 1 channel, {P['consumers']} consumers at RDY {RDY}, draining a "
                   f"backlog of {n:,} messages (published first with MPUB {MPUB_BATCH})")
    with Server(flags, args.dir) as srv:
        srv.create_channels(TOPIC, ["c0"])
        publish_backlog(report, srv, key, P, args)
        mark = time.monotonic()
        prof = profile_path(args, cfg, "consume1")
        gs, t0, phase, nprocs = consume(srv, [("c0", P["consumers"])], n, 1, None, prof,
                                        args.py_spy_rate, args.py_spy_native)
        g = gs[0]
        elapsed = g["t_end"] - t0
        rate = g["counted"] / elapsed
        if not g["drained"] or g["counted"] != n:
            report.note(f"!! received {g['received']:,} of {n:,}")
        report.add(f"{key}_msgs_per_s", rate, "consume msgs/s (received and FIN'd)", fmt=",.0f",
                   target=(f">= {TARGET_CONSUME_MSGS:,}", rate >= TARGET_CONSUME_MSGS))
        report.add(f"{key}_drain_s", elapsed, "time to drain the backlog (s)", fmt=",.2f")
        report.figures[f"{key}_redelivered_msgs"] = g["redelivered"]
        report.figures[f"{key}_consumers"] = P["consumers"]
        report.add(f"{key}_msgs_per_read", g["received"] / max(g["reads"], 1),
                   "messages per client socket read (mean)", fmt=",.1f")
        rss_note(report, key, srv)
        report.add(f"{key}_drain_rss_peak_mb", srv.rss.peak_since(mark),
                   "server RSS peak while draining", fmt=",.1f")
        cpu_note(report, key, phase, f"{nprocs} process, {P['consumers']} connections", rate)
    print_profile(report, prof)
    return rate


def part_channels20(report: Report, cfg: str, flags: list[str], P: dict, args,
                    consume1_rate: float | None) -> None:
    key = f"{cfg}_channels20"
    n = P["backlog"]
    nch = P["channels"]
    k = args.channel_consumers
    report.section(f"[{cfg}] (d) {nch} channels x {k} consumer(s) at RDY {RDY}, the same backlog "
                   f"of {n:,} ({nch * n:,} deliveries; measured until drained or "
                   f"{P['channels_max_s']:g} s)")
    with Server(flags, args.dir) as srv:
        names = [f"c{i:02d}" for i in range(nch)]
        srv.create_channels(TOPIC, names)
        publish_backlog(report, srv, key, P, args)
        mark = time.monotonic()
        prof = profile_path(args, cfg, "channels20")
        gs, t0, phase, nprocs = consume(srv, [(ch, k) for ch in names], n, args.procs,
                                        P["channels_max_s"], prof, args.py_spy_rate,
                                        args.py_spy_native)
        elapsed = max(g["t_end"] for g in gs) - t0
        total = sum(g["counted"] for g in gs)
        rate = total / elapsed
        per = sorted(g["counted"] / (g["t_end"] - t0) for g in gs)
        drained = sum(1 for g in gs if g["drained"])
        report.add(f"{key}_msgs_per_s", rate, f"total msgs/s over {nch} channels", fmt=",.0f")
        report.add(f"{key}_channel_min_msgs_per_s", per[0], "slowest channel msgs/s", fmt=",.0f")
        report.add(f"{key}_channel_max_msgs_per_s", per[-1], "fastest channel msgs/s", fmt=",.0f")
        report.add(f"{key}_measured_s", elapsed, f"measured (s); channels drained: {drained}/{nch}",
                   fmt=",.2f")
        report.figures[f"{key}_delivered_msgs"] = total
        report.figures[f"{key}_channels_drained"] = drained
        report.figures[f"{key}_consumers_per_channel"] = k
        report.figures[f"{key}_redelivered_msgs"] = sum(g["redelivered"] for g in gs)
        report.add(f"{key}_msgs_per_read", sum(g["received"] for g in gs)
                   / max(sum(g["reads"] for g in gs), 1),
                   "messages per client socket read (mean)", fmt=",.1f")
        if consume1_rate:
            ratio = rate / consume1_rate
            report.add(f"{key}_ratio_to_1", ratio, "ratio to (c) (one channel)", fmt=",.2f",
                       target=(f">= {TARGET_CHANNELS_RATIO:g}", ratio >= TARGET_CHANNELS_RATIO))
        rss_note(report, key, srv)
        report.add(f"{key}_drain_rss_peak_mb", srv.rss.peak_since(mark),
                   "server RSS peak while draining", fmt=",.1f")
        cpu_note(report, key, phase, f"{nprocs} process(es), {nch * k} connections", rate)
    print_profile(report, prof)


def timed_produce(srv: Server, cmd, per_cmd: int, conns: int, warm_s: float, dur_s: float,
                  args, profile: str | None = None, cmds: list[bytes] | None = None,
                  answers: int = 1):
    """`conns` connections, one send in flight each (of `answers` requests), for `dur_s`
    after `warm_s`: (msgs/s, sorted latencies in s, phase)."""
    specs = produce_specs(cmd, per_cmd, conns, min(args.procs, conns), warm_s=warm_s,
                          dur_s=dur_s)
    for s in specs:
        s["answers"] = answers
        if cmds:
            s["cmds"] = cmds
    results, _, phase = run_load(srv, specs, profile, args.py_spy_rate, args.py_spy_native)
    lat = array.array("d")
    for r in results:
        lat.frombytes(r["lat"])
    return sum(r["count"] for r in results) / dur_s, sorted(lat), phase


def latency_figures(report: Report, key: str, lat, what: str) -> None:
    report.add(f"{key}_p50_ms", percentile(lat, 50) * 1000, f"{what} latency p50 (ms)", fmt=",.2f")
    report.add(f"{key}_p99_ms", percentile(lat, 99) * 1000, f"{what} latency p99 (ms)", fmt=",.2f")


def part_mpub2(report: Report, cfg: str, flags: list[str], P: dict, args) -> None:
    key = f"{cfg}_mpub200x2"
    report.section(f"[{cfg}] (e) 2 connections, MPUB of {MPUB_BATCH} x {BODY_LEN} bytes, one in "
                   f"flight each (Go's bench_writer; {P['mpub_s']:g} s measured)")
    with Server(flags, args.dir) as srv:
        srv.command(cmd_pub(TOPIC, b"x" * BODY_LEN))
        prof = profile_path(args, cfg, "mpub200x2")
        rate, lat, phase = timed_produce(srv, cmd_mpub(TOPIC, bodies(MPUB_BATCH)), MPUB_BATCH, 2,
                                         P["mpub_warm_s"], P["mpub_s"], args, prof)
        report.add(f"{key}_msgs_per_s", rate, "MPUB msgs/s", fmt=",.0f")
        latency_figures(report, key, lat, "MPUB")
        cpu_note(report, key, phase, "1 process, 2 connections", rate)
    print_profile(report, prof)


def part_pubconns(report: Report, cfg: str, flags: list[str], P: dict, args) -> None:
    report.section(f"[{cfg}] (f) one {BODY_LEN}-byte PUB at a time on 1, 10 and 100 connections "
                   f"({P['conns_s']:g} s each)")
    with Server(flags, args.dir) as srv:
        srv.command(cmd_pub(TOPIC, b"x" * BODY_LEN))
        for conns in (1, 10, 100):
            key = f"{cfg}_pub1_c{conns}"
            rate, lat, phase = timed_produce(srv, cmd_pub(TOPIC, bodies(1)[0]), 1, conns,
                                             P["pub_warm_s"], P["conns_s"], args)
            report.add(f"{key}_msgs_per_s", rate, f"{conns} connection(s): PUB msgs/s", fmt=",.0f")
            latency_figures(report, key, lat, "PUB")
            cpu_note(report, key, phase, f"{conns} connection(s)", rate)


ISOLATION_TOPICS = 16
TARGET_ISOLATION_RATIO = 0.9
TARGET_ISOLATION_CPU_RATIO = 1.15
TARGET_LIGHT_P99_MS = 10.0


def part_isolation(report: Report, cfg: str, flags: list[str], P: dict, args) -> None:
    key = f"{cfg}_isolation"
    conns = P["pub_conns"]
    spread = ", ".join(map(str, args.topics))
    report.section(f"[{cfg}] (g) partitions apart: {conns} connections on 1 topic, then spread "
                   f"over {spread} topics, one PUB at a time each; then 1 light connection on "
                   f"its own topic beside {conns} on a saturated one ({P['conns_s']:g} s each)")
    with Server(flags, args.dir) as srv:
        topics = [f"iso{i:02d}" for i in range(3)]
        for t in topics:
            srv.command(cmd_pub(t, b"x" * BODY_LEN))
        body = bodies(1)[0]
        one, _, phase1 = timed_produce(srv, cmd_pub(topics[0], body), 1, conns, P["pub_warm_s"],
                                       P["conns_s"], args)
        report.add(f"{key}_one_topic_msgs_per_s", one, f"1 topic, {conns} connections: msgs/s",
                   fmt=",.0f")
        cpu_note(report, f"{key}_one_topic", phase1, f"{conns} connections", one)
        for n in args.topics:
            for i in range(len(topics), n):
                topics.append(f"iso{i:02d}")
                srv.command(cmd_pub(topics[-1], b"x" * BODY_LEN))
            many, _, phase = timed_produce(srv, cmd_pub(topics[0], body), 1, conns,
                                           P["pub_warm_s"], P["conns_s"], args,
                                           cmds=[cmd_pub(t, body) for t in topics[:n]])
            report.add(f"{key}_{n}_topics_msgs_per_s", many,
                       f"{n} topics, {conns} connections: total msgs/s", fmt=",.0f")
            ratio = many / one if one else float("nan")
            report.add(f"{key}_ratio_{n}_to_1", ratio, f"{n} topics / 1 topic", fmt=",.2f",
                       target=(f">= {TARGET_ISOLATION_RATIO:g}", ratio >= TARGET_ISOLATION_RATIO))
            cpu_note(report, f"{key}_{n}_topics", phase, f"{conns} connections", many)
            cpu_ratio = (phase.server_cpus / many) / (phase1.server_cpus / one) if many else 0
            report.add(f"{key}_cpu_ratio_{n}_to_1", cpu_ratio,
                       f"{n} topics / 1 topic: server CPU per message", fmt=",.2f",
                       target=(f"<= {TARGET_ISOLATION_CPU_RATIO:g}",
                               cpu_ratio <= TARGET_ISOLATION_CPU_RATIO))

        light_topic, busy_topic = topics[1], topics[2]
        specs = produce_specs(cmd_pub(busy_topic, body), 1, conns, 1, warm_s=P["pub_warm_s"],
                              dur_s=P["conns_s"])
        specs += produce_specs(cmd_pub(light_topic, body), 1, 1, 1, warm_s=P["pub_warm_s"],
                               dur_s=P["conns_s"])
        results, _, _ = run_load(srv, specs, None, 0)
        busy, light = results
        lat = sorted(array.array("d", light["lat"]))
        report.add(f"{key}_busy_msgs_per_s", busy["count"] / P["conns_s"],
                   "saturated topic: msgs/s", fmt=",.0f")
        report.add(f"{key}_light_msgs_per_s", light["count"] / P["conns_s"],
                   "light topic: msgs/s", fmt=",.0f")
        p99 = percentile(lat, 99) * 1000
        report.add(f"{key}_light_p50_ms", percentile(lat, 50) * 1000, "light topic: PUB p50 (ms)",
                   fmt=",.2f")
        report.add(f"{key}_light_p99_ms", p99, "light topic: PUB p99 (ms)", fmt=",.2f",
                   target=(f"< {TARGET_LIGHT_P99_MS:g}", p99 < TARGET_LIGHT_P99_MS))


PIPELINE_CONNS = 4
PIPELINE_DEPTH = 32


def part_pipelined(report: Report, cfg: str, flags: list[str], P: dict, args) -> None:
    key = f"{cfg}_pipelined"
    report.section(f"[{cfg}] (h) {PIPELINE_CONNS} connections, {PIPELINE_DEPTH} {BODY_LEN}-byte "
                   f"PUBs sent together on each, the next {PIPELINE_DEPTH} once all are answered "
                   f"({P['conns_s']:g} s)")
    with Server(flags, args.dir) as srv:
        srv.command(cmd_pub(TOPIC, b"x" * BODY_LEN))
        prof = profile_path(args, cfg, "pipelined")
        rate, lat, phase = timed_produce(srv, cmd_pub(TOPIC, bodies(1)[0]) * PIPELINE_DEPTH,
                                         PIPELINE_DEPTH, PIPELINE_CONNS, P["pub_warm_s"],
                                         P["conns_s"], args, prof, answers=PIPELINE_DEPTH)
        report.add(f"{key}_msgs_per_s", rate, "PUB msgs/s", fmt=",.0f")
        latency_figures(report, key, lat, f"{PIPELINE_DEPTH} PUBs")
        cpu_note(report, key, phase, f"1 process, {PIPELINE_CONNS} connections", rate)
    print_profile(report, prof)


def part_named(report: Report, cfg: str, flags: list[str], P: dict, args) -> None:
    key = f"{cfg}_named"
    report.section(f"[{cfg}] (i) idempotent producers: PUB_EXT on {P['pub_conns']} "
                   f"connections and MPUB_EXT of {MPUB_BATCH} on 2, named against unnamed, "
                   f"{args.rounds} alternated rounds ({P['conns_s']:g} s each)")
    loads = {"pub1": (P["pub_conns"], bodies(1)), "mpub200": (2, bodies(MPUB_BATCH))}
    got: dict = {}
    for _ in range(args.rounds):
        for load, (conns, bs) in loads.items():
            for named in (False, True):
                with Server(flags, args.dir) as srv:
                    srv.command(cmd_pub(TOPIC, b"x" * BODY_LEN))
                    cmd = (cmd_pub_ext(TOPIC, {}, bs[0]) if len(bs) == 1
                           else cmd_mpub_ext(TOPIC, [({}, b) for b in bs]))
                    specs = produce_specs(cmd, len(bs), conns, min(args.procs, conns),
                                          warm_s=P["pub_warm_s"], dur_s=P["conns_s"])
                    for spec in specs:
                        if named:
                            spec["named"] = (TOPIC, bs)
                    prof = profile_path(args, cfg, f"named_{load}_{int(named)}")
                    results, _, phase = run_load(srv, specs, prof, args.py_spy_rate,
                                                 args.py_spy_native)
                print_profile(report, prof)
                lat = array.array("d")
                for r in results:
                    lat.frombytes(r["lat"])
                rate = sum(r["count"] for r in results) / P["conns_s"]
                got.setdefault((load, named), []).append(
                    (rate, phase.server_cpus / rate * 1e6, percentile(sorted(lat), 99) * 1000))
    for load in loads:
        med = {named: [statistics.median([r[i] for r in got[(load, named)]]) for i in range(3)]
               for named in (False, True)}
        for named, (rate, cpu, p99) in med.items():
            tag = f"{key}_{load}_{'named' if named else 'unnamed'}"
            report.add(f"{tag}_msgs_per_s", rate, f"{load} {'named' if named else 'unnamed'} "
                       "msgs/s (median)", fmt=",.0f")
            report.add(f"{tag}_server_cpu_us_per_msg", cpu, "server CPU per message (µs)",
                       fmt=",.2f")
            report.add(f"{tag}_p99_ms", p99, "latency p99 (ms)", fmt=",.2f")
        report.add(f"{key}_{load}_msgs_ratio", med[True][0] / med[False][0],
                   f"{load}: named / unnamed msgs/s", fmt=".3f")
        report.add(f"{key}_{load}_cpu_ratio", med[True][1] / med[False][1],
                   f"{load}: named / unnamed server CPU per message", fmt=".3f")
        report.add(f"{key}_{load}_cpu_us_added", med[True][1] - med[False][1],
                   f"{load}: server CPU per message added by naming (µs)", fmt=",.2f")


# =============================================================================

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller: under a minute")
    ap.add_argument("--only", default="a,b,c,d,e,f,g,h,i",
                    help="parts to run, e.g. a,c (d needs c for its ratio)")
    ap.add_argument("--configs", default="durable,sync10000",
                    help="server configurations: durable (defaults: the node journal), sync10000 "
                         "(--sync-every 10000), threads (--journal false)")
    ap.add_argument("--procs", type=int, default=1,
                    help="load-generator processes for producers and for (d) (default 1: the "
                         "server needs one of the 2 CPUs)")
    ap.add_argument("--channel-consumers", type=int, default=1,
                    help="consumers per channel in (d) (default 1)")
    ap.add_argument("--backlog", type=int, help="backlog messages for (c) and (d)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of (i)")
    ap.add_argument("--topics", default=str(ISOLATION_TOPICS),
                    help="(g): the numbers of topics the load is spread over, e.g. 16,100,1000 "
                         "(with more topics than connections each connection takes them in "
                         "turn)")
    ap.add_argument("--dir", help="temporary data paths inside DIR (default: the system temp dir)")
    ap.add_argument("--nsqd-root", metavar="DIR",
                    help="run the nsqd of the checkout in DIR (e.g. `git worktree add /tmp/base "
                         "main`), for before/after pairs; the load generators stay this one's")
    ap.add_argument("--py-spy", metavar="DIR", help="record the server with py-spy during each "
                    "measured phase into DIR/<config>_<part>.txt and print a summary")
    ap.add_argument("--py-spy-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--py-spy-native", action="store_true",
                    help="py-spy --native (C frames too; pauses the server at each sample: slower)")
    args = ap.parse_args()
    args.topics = [int(n) for n in args.topics.split(",")]
    P = dict(QUICK if args.quick else FULL)
    if args.backlog:
        P["backlog"] = args.backlog
    parts = set(args.only.split(","))
    if args.nsqd_root:
        nsqd_server.ROOT = os.path.abspath(args.nsqd_root)  # Server loads its tests/servers.py
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}")

    report = Report("nsqd")
    load0 = os.getloadavg()
    t_start = time.monotonic()
    info = common.machine_info()
    report.figures["nsqd_root"] = nsqd_server.ROOT
    report.figures.update(python=info["python"], cpus=info["cpus"], quick=args.quick,
                          loadavg_1m_start=round(load0[0], 2))
    print(f"nsqd benchmark{' (quick)' if args.quick else ''}: Python {info['python']}, "
          f"{info['cpus']} CPUs, load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    print(f"   server and load generators share these {info['cpus']} CPUs; load generators: "
          f"{args.procs} process(es) for producers and (d), 1 for (c); uvloop on both sides")
    print(f"   messages: {BODY_LEN}-byte bodies; nsqd from tests/servers.py NsqdProcess, "
          "fresh data path per part, --log-level warning")

    report.section("disk: one 236-byte write + fdatasync at a time (noise indicator)")
    report.add("fsync_bound_syncs_per_s", fsync_bound(args.dir, P["fsync_s"]),
               "write+fdatasync per second", fmt=",.0f")

    report.section("reference: Go nsqd v1.3.0 on this kind of machine (its own bench tools, "
                   "200-byte messages)")
    for k, v, label in GO_REFERENCE:
        report.add(k, v, label, fmt=",")

    for cfg in configs:
        flags = CONFIGS[cfg]
        c_rate = None
        report.section(f"configuration {cfg}: nsqd {' '.join(flags) or '(defaults: every batch synced before OK)'}")
        if "a" in parts:
            part_pub1(report, cfg, flags, P, args)
        if "b" in parts:
            part_mpub(report, cfg, flags, P, args)
        if "c" in parts:
            c_rate = part_consume1(report, cfg, flags, P, args)
        if "d" in parts:
            part_channels20(report, cfg, flags, P, args, c_rate)
        if "e" in parts:
            part_mpub2(report, cfg, flags, P, args)
        if "f" in parts:
            part_pubconns(report, cfg, flags, P, args)
        if "g" in parts:
            part_isolation(report, cfg, flags, P, args)
        if "h" in parts:
            part_pipelined(report, cfg, flags, P, args)
        if "i" in parts:
            part_named(report, cfg, flags, P, args)

    report.section("end")
    report.add("fsync_bound_end_syncs_per_s", fsync_bound(args.dir, P["fsync_s"]),
               "write+fdatasync per second, again", fmt=",.0f")
    load1 = os.getloadavg()
    report.add("loadavg_1m_end", round(load1[0], 2), "load average (1 min) at end", fmt=".2f")
    report.add("loadavg_1m_start", round(load0[0], 2), "load average (1 min) at start", fmt=".2f")
    report.add("bench_s", time.monotonic() - t_start, "benchmark wall time (s)", fmt=",.1f")
    if load0[0] > 0.5 or load1[0] > 0.5:
        report.note("the load average shows other work on the machine: compare *_other_cpus "
                    "and the fsync bounds (about 4,400-5,800/s on an idle machine of this kind), "
                    "and distrust absolute figures when they are off")
    report.emit_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
