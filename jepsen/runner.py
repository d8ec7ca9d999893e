"""One run: set the cluster up, create the topic, run the workload while the nemesis
faults and heals at intervals, heal everything, drain, check, write the report, tear
down. Teardown always runs (an exception, Ctrl-C, SIGTERM: one handler turns SIGINT and
SIGTERM into KeyboardInterrupt, raised where the main thread is, so asyncio.run never
installs its own SIGINT handler, which only cancels the main task: an await that
swallowed that cancellation let an interrupted run go on to its end)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field

import structlog

from jepsen import checker, dead_letters, halves, replicas, report
from jepsen.cluster import make_cluster
from jepsen.clients import CHANNEL, Workload
from jepsen.history import History, read
from jepsen.nemesis import Nemesis

TOPIC = "jepsen"


@dataclass
class RunOptions:
    nemesis: list[str] = field(default_factory=lambda: ["partition", "kill", "pause"])
    time_limit: float = 120.0
    nodes: int = 5
    lookupds: int = 3
    replicas: int = 1
    partitions: int = 6
    interval: float = 10.0  # seconds of quiet, then seconds of fault, in turn
    store: str = ""
    loopback: bool = False
    nsqd_flags: list[str] = field(default_factory=list)
    seed: int = 0
    drain_timeout: float = 90.0
    drain_quiet: float = 10.0  # the drain gives up after this long with nothing new
    keep_data: bool = False
    classic: bool = True
    pause_s: float = 0.05  # each producer's pause between its operations
    unkeyed: int = 2  # unkeyed producer processes (beside one keyed per partition)
    disk_mb: int = 64  # each nsqd's tmpfs (network namespaces only)
    ordered: bool = False  # an ordered topic, ordered consumers (no classic producer then)
    sync_every: int = 1  # the topic's syncdisk: 1 syncs every batch before its OK
    poison: int = 0  # every poison-th nsqclient message always fails: a dead letter (0: none)
    max_attempts: int = 3  # the channel's, with poison
    halves: int = 0  # every halves-th nsqclient message is a half message (0: none)


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _client_logs(path: str):
    """The clients' logs (nsqclient's structlog, pynsq's logging) go to one file."""
    f = open(path, "a", buffering=1)
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.dev.ConsoleRenderer(colors=False)],
        logger_factory=structlog.WriteLoggerFactory(f), cache_logger_on_first_use=False)
    handler = logging.StreamHandler(f)
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    return f, handler


def run(opts: RunOptions) -> dict:
    """Run once; returns the summary (its `valid` says pass or fail)."""
    seed = opts.seed or int(time.time())
    rng = random.Random(seed)
    nsqd_flags = [*opts.nsqd_flags, *(halves.NSQD_FLAGS if opts.halves else ())]
    cluster = make_cluster(opts.store, opts.nodes, opts.lookupds, nsqd_flags,
                           opts.loopback, opts.disk_mb, powerfs="power-cut" in opts.nemesis,
                           clock_skew="clock-skew" in opts.nemesis)
    nemesis = Nemesis(cluster, TOPIC, opts.nemesis, rng)  # checks the kinds before setup
    os.makedirs(os.path.join(opts.store, "logs"), exist_ok=True)
    log_file, handler = _client_logs(os.path.join(opts.store, "logs", "clients.log"))
    history_path = os.path.join(opts.store, "history.jsonl")
    history = History(history_path)
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in INTERRUPTS}
    info = dict(asdict(opts), seed=seed, cluster=type(cluster).__name__)
    post: dict = {}  # what the run found after the final heal (liveness), for the checkers
    copies = None
    try:
        print(f"jepsen: setting up {opts.nodes} hosts ({type(cluster).__name__}) in "
              f"{opts.store}", flush=True)
        cluster.setup()
        cluster.create_topic(TOPIC, opts.partitions, opts.replicas, opts.ordered,
                             opts.sync_every)
        info["ordered"] = cluster.ordered(TOPIC)
        asyncio.run(_phases(opts, cluster, nemesis, history, info, post))
        if opts.replicas > 1:
            print("jepsen: waiting for full ISRs, stopping the cluster cleanly, reading "
                  "every replica", flush=True)
            copies = replicas.collect(cluster, TOPIC, opts.partitions, opts.replicas)
    finally:
        history.close()
        cluster.teardown()
        for sig, before in previous.items():
            signal.signal(sig, before)
        logging.getLogger().removeHandler(handler)
        structlog.reset_defaults()
        log_file.close()
    ops = read(history_path)
    results = checker.check(ops, info.get("ordered", False), post.get("liveness"))
    acknowledged = {inv["value"]["id"] for inv, done in checker.pairs(ops)
                    if done and done["type"] == "ok"}
    results["replicas"] = replicas.check(copies, acknowledged)
    results["valid"] = results["valid"] and results["replicas"]["valid"] in (True, "skipped")
    index = report.write(opts.store, ops, results, info)
    if results["valid"] and not opts.keep_data:
        shutil.rmtree(cluster.data, ignore_errors=True)
    summary = {"valid": results["valid"], "index": index, **{
        k: v for k, v in results.items() if k != "valid"}}
    return summary


async def _phases(opts: RunOptions, cluster, nemesis: Nemesis, history: History,
                  info: dict, post: dict) -> None:
    lookupds = cluster.lookupd_http_addresses
    nsqds = [h.nsqd_tcp for h in cluster.hosts]
    async with contextlib.AsyncExitStack() as stack:  # stops the workload, then the server
        check_url = None
        if opts.halves:
            server = await halves.CheckServer(history, cluster.harness_ip).start()
            stack.push_async_callback(server.stop)
            check_url = server.url
        workload = Workload(history, TOPIC, opts.partitions, lookupds, nsqds,
                            unkeyed=opts.unkeyed, pause_s=opts.pause_s,
                            classic=opts.classic and not opts.ordered, ordered=opts.ordered,
                            poison=opts.poison, halves=opts.halves, check_url=check_url)
        stack.push_async_callback(workload.close)
        await workload.start()
        if opts.poison:
            await asyncio.to_thread(dead_letters.setup, cluster, TOPIC, CHANNEL,
                                    opts.max_attempts, opts.partitions)
        deadline = time.monotonic() + opts.time_limit
        while opts.nemesis and time.monotonic() + 2 * opts.interval <= deadline:
            await asyncio.sleep(opts.interval)
            fault = await asyncio.to_thread(nemesis.start)
            history.record("info", "start", "nemesis", fault)
            print(f"jepsen: {history.now():6.1f} s fault {fault}", flush=True)
            await asyncio.sleep(opts.interval)
            healed = await asyncio.to_thread(nemesis.stop)
            history.record("info", "stop", "nemesis", healed)
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        healed = await asyncio.to_thread(nemesis.final_heal)
        history.record("info", "final-heal", "nemesis", healed)
        print(f"jepsen: {history.now():6.1f} s final heal {healed}", flush=True)
        healed_at = history.now()
        await asyncio.to_thread(cluster.wait, lambda: len(cluster.leaders(TOPIC)) ==
                                opts.partitions, 60, "every partition led after the heal")
        post["liveness"] = await _writable_again(workload, history, healed_at, LIVENESS_S)
        await workload.stop_producing()
        history.record("info", "drain", "nemesis", {"acknowledged": len(workload.acknowledged)})
        info["drain_s"] = await _drain(workload, opts.drain_timeout, opts.drain_quiet)
        if opts.poison:
            info["dead_letters"] = await asyncio.to_thread(dead_letters.collect, cluster,
                                                           TOPIC, CHANNEL, history)


LIVENESS_S = 30.0  # after the final heal, every partition must take a write within this


async def _writable_again(workload: Workload, history: History, healed_at: float,
                          bound_s: float) -> dict:
    """Wait until every partition acknowledged a keyed publish invoked after the final
    heal (a partition wedged for good never does), at most `bound_s`."""
    while True:
        waited = history.now() - healed_at
        after = {n: t for n, t in workload.last_ok_invoke.items() if t >= healed_at}
        if len(after) == workload.partitions or waited > bound_s:
            break
        await asyncio.sleep(0.2)
    return {"bound_s": bound_s,
            "partitions_s": {n: round(after[n] - healed_at, 2) for n in sorted(after)},
            "never": sorted(set(range(workload.partitions)) - set(after))}


async def _drain(workload: Workload, timeout: float, quiet: float) -> float:
    """Consumers read until every acknowledged enqueue was seen, or nothing new came for
    `quiet` seconds, or `timeout`; returns how long it took."""
    start = time.monotonic()
    last, seen = start, len(workload.dequeued)
    while time.monotonic() - start < timeout and workload.missing():
        await asyncio.sleep(0.5)
        if len(workload.dequeued) != seen:
            last, seen = time.monotonic(), len(workload.dequeued)
        elif time.monotonic() - last > quiet:
            break
    await asyncio.sleep(1.0)  # late redeliveries still count as duplicates
    return round(time.monotonic() - start, 2)
