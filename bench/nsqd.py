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
and all of it twice: nsqd's defaults (durable: every batch synced before OK), then
`--sync-every 10000`. Prints readable lines, then ONE line of JSON with every figure.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import importlib.util
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# This file is bench/nsqd.py: with bench/ on sys.path, `import nsqd` would import this
# script itself. Take `common` from bench/, then drop bench/ from the path.
sys.path.insert(0, HERE)
import common  # noqa: E402
from common import MB, Report, percentile  # noqa: E402

sys.path[:] = [x for x in sys.path if os.path.abspath(x or os.curdir) != HERE]
try:
    import nsqd.protocol  # noqa: F401  (installed editable in the venv)
except ImportError:  # a checkout without the install: append, never shadow stdlib
    sys.path.append(ROOT)
from nsqclient.commands import FrameParser, cmd_cls, cmd_mpub, cmd_nop, cmd_pub, cmd_rdy, cmd_sub  # noqa: E402
from nsqd import protocol as p  # noqa: E402

BODY_LEN = 200
TOPIC = "bench"
MPUB_BATCH = 200
RDY = 200
FRAME = struct.Struct(">ii")

FULL = dict(pub_conns=100, pub_warm_s=1.0, pub_s=10.0, mpub_conns=4, mpub_warm_s=1.0,
            mpub_s=10.0, backlog=1_000_000, backlog_conns=4, consumers=4, channels=20,
            channels_max_s=25.0, fsync_s=1.0)
QUICK = dict(pub_conns=100, pub_warm_s=0.5, pub_s=3.0, mpub_conns=4, mpub_warm_s=0.5,
             mpub_s=3.0, backlog=100_000, backlog_conns=4, consumers=4, channels=20,
             channels_max_s=5.0, fsync_s=0.5)

CONFIGS = {"durable": [], "sync10000": ["--sync-every", "10000"]}

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


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# =============================================================================
# Load generators (run in child processes)
# =============================================================================

class ProduceJob:
    """Connections that each send `cmd` (a PUB or an MPUB), wait for OK, and send again:
    for a time window (`warm_s` unmeasured, then `dur_s` measured) or `batches` times."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.cmd: bytes = spec["cmd"]
        self.per_cmd: int = spec["per_cmd"]
        self.timed = spec.get("dur_s") is not None
        self.count = 0
        self.lat = array.array("d")
        self.errors: list[str] = []
        self.m_start = self.m_end = 0.0
        self.t_last = 0.0
        self.conns: list[Producer] = []
        self.open = 0
        self.done: asyncio.Future | None = None

    async def connect(self, loop) -> None:
        self.done = loop.create_future()
        batches = self.spec.get("batches") or [0] * self.spec["conns"]
        for i in range(self.spec["conns"]):
            _, proto = await loop.create_connection(lambda: Producer(self), self.spec["host"],
                                                    self.spec["port"])
            proto.left = batches[i]
            self.conns.append(proto)

    async def run(self, t0: float) -> dict:
        self.m_start = t0 + self.spec.get("warm_s", 0.0)
        self.m_end = self.m_start + (self.spec.get("dur_s") or 0.0)
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        for c in self.conns:
            if self.timed or c.left > 0:
                self.open += 1
                c.send()
        if self.open:
            await self.done
        for c in self.conns:
            c.transport.close()
        return {"count": self.count, "lat": self.lat.tobytes(), "t_last": self.t_last,
                "errors": self.errors[:5], "n_errors": len(self.errors)}

    def finished(self, conn) -> None:
        if conn.finished:
            return
        conn.finished = True
        self.open -= 1
        if self.open == 0 and not self.done.done():
            self.done.set_result(None)


class Producer(asyncio.Protocol):
    def __init__(self, job: ProduceJob):
        self.job = job
        self.frames = FrameParser()
        self.transport = None
        self.t_sent = 0.0
        self.left = 0
        self.finished = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(p.MAGIC_V2)

    def send(self) -> None:
        self.t_sent = time.monotonic()
        self.transport.write(self.job.cmd)

    def data_received(self, data: bytes) -> None:
        f = self.frames
        f.feed(data)
        for kind, payload in f.frames():
            if kind == p.FRAME_RESPONSE:
                if payload == b"OK":
                    self._ok()
                elif payload == b"_heartbeat_":
                    self.transport.write(cmd_nop())
            else:
                self.job.errors.append(payload[:200].decode(errors="replace"))
                self.job.finished(self)

    def _ok(self) -> None:
        now = time.monotonic()
        job = self.job
        if job.timed:
            if self.t_sent >= job.m_start and now <= job.m_end:
                job.count += job.per_cmd
                job.lat.append(now - self.t_sent)
            if now < job.m_end:
                self.t_sent = now
                self.transport.write(job.cmd)
            else:
                job.finished(self)
        else:
            job.count += job.per_cmd
            job.lat.append(now - self.t_sent)
            job.t_last = now
            self.left -= 1
            if self.left > 0:
                self.t_sent = now
                self.transport.write(job.cmd)
            else:
                job.finished(self)

    def connection_lost(self, exc) -> None:
        if not self.finished:
            self.job.errors.append(f"connection lost: {exc}")
            self.job.finished(self)


class Group:
    """The consumers of one channel (all in this process): done when `expected` messages
    are received (then CLS; CLOSE_WAIT confirms every earlier FIN was processed), or at
    the deadline (what was received until then counts)."""

    def __init__(self, channel: str, expected: int):
        self.channel = channel
        self.expected = expected
        self.received = 0
        self.counted = 0
        self.redelivered = 0
        self.reads = 0  # socket reads that brought messages
        self.consumers: list[Consumer] = []
        self.closing = False
        self.drained = False
        self.closed = 0
        self.t_end = 0.0
        self.fut: asyncio.Future | None = None

    def close(self, drained: bool) -> None:
        if self.closing:
            return
        self.closing = True
        self.drained = drained
        if not drained:  # deadline: count until now
            self.counted = self.received
            self.t_end = time.monotonic()
        for c in self.consumers:
            if not c.transport.is_closing():
                c.transport.write(cmd_cls())

    def consumer_closed(self) -> None:
        self.closed += 1
        if self.closed == len(self.consumers) and not self.fut.done():
            if self.drained:
                self.counted = self.received
                self.t_end = time.monotonic()
            self.fut.set_result(None)


class Consumer(asyncio.Protocol):
    def __init__(self, group: Group, rdy: int, errors: list):
        self.group = group
        self.rdy = rdy
        self.errors = errors
        self.transport = None
        self.buf = bytearray()
        self.subscribed = False
        self.done = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(p.MAGIC_V2)

    def start(self) -> None:
        self.transport.write(cmd_sub(TOPIC, self.group.channel))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        n = len(buf)
        pos = 0
        ids = []
        unpack = FRAME.unpack_from
        while n - pos >= 8:
            size, kind = unpack(buf, pos)
            end = pos + 4 + size
            if end > n:
                break
            if kind == p.FRAME_MESSAGE:
                # size, type, timestamp (8), attempts (2), id (16), body
                ids.append(buf[pos + 18:pos + 34])
                if buf[pos + 17] != 1 or buf[pos + 16]:
                    self.group.redelivered += 1
            else:
                self._other(kind, bytes(buf[pos + 8:end]))
            pos = end
        if pos:
            del buf[:pos]
        if ids:
            self.transport.write(b"FIN " + b"\nFIN ".join(ids) + b"\n")
            g = self.group
            g.received += len(ids)
            g.reads += 1
            if g.received >= g.expected:
                g.close(drained=True)

    def _other(self, kind: int, payload: bytes) -> None:
        if kind == p.FRAME_RESPONSE:
            if payload == b"OK" and not self.subscribed:
                self.subscribed = True
                self.transport.write(cmd_rdy(self.rdy))
            elif payload == b"_heartbeat_":
                self.transport.write(cmd_nop())
            elif payload == b"CLOSE_WAIT":
                self._closed()
        else:
            self.errors.append(payload[:200].decode(errors="replace"))
            if not payload.startswith((b"E_FIN_FAILED", b"E_REQ_FAILED", b"E_TOUCH_FAILED")):
                self._closed()

    def _closed(self) -> None:
        if not self.done:
            self.done = True
            if not self.group.closing:
                self.group.close(drained=False)
            self.group.consumer_closed()

    def connection_lost(self, exc) -> None:
        if not self.done:
            self.errors.append(f"connection lost: {exc}")
            self._closed()


class ConsumeJob:
    """Groups of consumers, one group per channel (spec["groups"]: [(channel, consumers)])."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.groups = [Group(ch, spec["expected"]) for ch, _ in spec["groups"]]
        self.errors: list[str] = []

    async def connect(self, loop) -> None:
        for group, (_, k) in zip(self.groups, self.spec["groups"]):
            group.fut = loop.create_future()
            for _ in range(k):
                _, proto = await loop.create_connection(
                    lambda: Consumer(group, self.spec["rdy"], self.errors), self.spec["host"],
                    self.spec["port"])
                group.consumers.append(proto)

    async def run(self, t0: float) -> dict:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        for g in self.groups:
            for c in g.consumers:
                c.start()
        max_s = self.spec.get("max_s")
        if max_s:
            def deadline():
                for g in self.groups:
                    g.close(drained=False)
            loop.call_at(loop.time() + max(0.0, t0 + max_s - time.monotonic()), deadline)
        await asyncio.gather(*(g.fut for g in self.groups))
        for g in self.groups:
            for c in g.consumers:
                c.transport.close()
        return {"groups": [{"channel": g.channel, "counted": g.counted, "received": g.received,
                            "t_end": g.t_end, "drained": g.drained,
                            "redelivered": g.redelivered, "reads": g.reads}
                           for g in self.groups],
                "count": sum(g.counted for g in self.groups),
                "errors": self.errors[:5], "n_errors": len(self.errors)}


async def _worker(spec: dict, pipe) -> None:
    loop = asyncio.get_running_loop()
    job = ProduceJob(spec) if spec["kind"] == "produce" else ConsumeJob(spec)
    await job.connect(loop)
    pipe.send(("ready", None))
    msg = await loop.run_in_executor(None, pipe.recv)
    if msg[0] != "go":
        return
    cpu0 = cpu_seconds()
    result = await asyncio.wait_for(job.run(msg[1]), spec["timeout_s"])
    result["cpu_s"] = cpu_seconds() - cpu0
    pipe.send(("result", result))


def worker_main(spec: dict, pipe) -> None:
    import uvloop

    try:
        uvloop.run(_worker(spec, pipe))
    except BaseException as e:  # report, never hang the parent
        try:
            pipe.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass


class Workers:
    """Load-generator processes: start, wait until connected, go, collect results."""

    def __init__(self, specs: list[dict]):
        ctx = multiprocessing.get_context("spawn")
        self.procs = []
        self.pipes = []
        for spec in specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, child), daemon=True)
            self.procs.append(proc)
            self.pipes.append(parent)
        self.timeout_s = max(s["timeout_s"] for s in specs) + 30

    def start(self) -> None:
        for proc in self.procs:
            proc.start()
        for pipe in self.pipes:
            kind, value = self._recv(pipe, 60)
            if kind != "ready":
                raise RuntimeError(f"load generator failed to start: {value}")

    def go(self, t0: float) -> None:
        for pipe in self.pipes:
            pipe.send(("go", t0))

    def results(self) -> list[dict]:
        out = []
        for pipe in self.pipes:
            kind, value = self._recv(pipe, self.timeout_s)
            if kind != "result":
                raise RuntimeError(f"load generator failed: {value}")
            out.append(value)
        return out

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop", None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)

    @staticmethod
    def _recv(pipe, timeout: float):
        if not pipe.poll(timeout):
            return "error", f"no answer in {timeout:.0f} s"
        try:
            return pipe.recv()
        except EOFError:
            return "error", "load generator exited"


# =============================================================================
# The server side: process, RSS, CPU, profiles
# =============================================================================

def _load_servers():
    spec = importlib.util.spec_from_file_location("_bench_servers",
                                                  os.path.join(ROOT, "tests", "servers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pid_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    return float("nan")


def pid_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (/proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PidRssSampler(common.RssSampler):
    """common.RssSampler for another process: VmRSS of `pid` every `interval` s, from a thread."""

    def __init__(self, pid: int, interval: float = 0.1):
        super().__init__(interval)
        self.pid = pid

    def _run(self) -> None:
        while True:
            rss = pid_rss_mb(self.pid)
            if rss == rss:  # not NaN: the process still runs
                self.samples.append((time.monotonic() - self._t0, rss))
            if self._stop.wait(self.interval):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak_since(self, t: float) -> float:
        vals = [v for s, v in self.samples if s >= t - self._t0]
        return max(vals) if vals else float("nan")


class Server:
    """A fresh nsqd on a fresh data path, with its RSS sampled every 100 ms."""

    def __init__(self, flags: list[str], base_dir: str | None):
        self.flags = flags
        self.base_dir = base_dir
        self.tmp = ""
        self.proc = None
        self.rss: PidRssSampler | None = None

    def __enter__(self) -> "Server":
        servers = _load_servers()
        self.tmp = tempfile.mkdtemp(prefix="bench-nsqd-", dir=self.base_dir)
        self.proc = servers.NsqdProcess(os.path.join(self.tmp, "data"), "--log-level", "warning",
                                        *self.flags)
        self.proc.start()
        self.pid = self.proc.proc.pid
        self.host, self.port = "127.0.0.1", self.proc.tcp_port
        self.rss = PidRssSampler(self.pid).__enter__()
        self.rss_start_mb = pid_rss_mb(self.pid)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.rss.__exit__()
            if self.proc.proc.poll() is not None:
                print(f"   !! nsqd exited early ({self.proc.proc.returncode}): {self.proc.log()[-1500:]}",
                      flush=True)
            else:
                self.proc.stop(60)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def rss_peak_mb(self) -> float:
        return self.rss.peak

    def command(self, data: bytes, replies: int = 1) -> list[bytes]:
        """Send commands on a fresh blocking connection; return `replies` response payloads."""
        with socket.create_connection((self.host, self.port), timeout=30) as s:
            s.sendall(p.MAGIC_V2 + data)
            parser = FrameParser()
            out = []
            while len(out) < replies:
                chunk = s.recv(65536)
                if not chunk:
                    raise RuntimeError(f"nsqd closed the connection: {out}")
                parser.feed(chunk)
                for kind, payload in parser.frames():
                    if kind == p.FRAME_ERROR:
                        raise RuntimeError(payload.decode(errors="replace"))
                    if payload != b"_heartbeat_":
                        out.append(payload)
            return out

    def create_channels(self, names: list[str]) -> None:
        """SUB once to each channel and leave: the channels exist before the backlog is
        published (a channel made later starts at the end of the topic)."""
        for name in names:
            self.command(cmd_sub(TOPIC, name))


class Profiler:
    """py-spy record of the server during one measured phase (raw collapsed stacks)."""

    def __init__(self, pid: int, path: str | None, rate: int, native: bool = False):
        self.path = path
        self.proc = None
        if path:
            exe = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
            if exe is None:
                print("   !! py-spy not found (.venv/bin/pip install py-spy): no profile", flush=True)
                self.path = None
                return
            self.proc = subprocess.Popen(
                [exe, "record", "-p", str(pid), "-r", str(rate),
                 "--native" if native else "--nonblocking", "-f", "raw", "-o", path],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # attached before the load starts

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def summarize_profile(path: str, top: int = 12) -> list[str]:
    """Top functions of a py-spy raw (collapsed) file: the event-loop thread (stacks under
    nsqd/main.py) by self and total samples, then the other threads (storage workers)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return [f"(no profile at {path})"]

    def name(frame: str) -> str:
        # "func (path/to/file.py:123)" -> "func (dir/file.py)"
        fn, _, loc = frame.partition(" (")
        loc = loc.rstrip(")").rsplit(":", 1)[0]
        return f"{fn} ({'/'.join(loc.split('/')[-2:])})"

    stats = {"loop": [0, Counter(), Counter()], "other": [0, Counter(), Counter()]}
    for line in lines:
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        frames = [name(f) for f in stack.split(";")]
        s = stats["loop" if "main (nsqd/main.py)" in frames else "other"]
        s[0] += n
        s[1][frames[-1]] += n
        for fr in set(frames):
            s[2][fr] += n
    samples = stats["loop"][0] + stats["other"][0]
    if not samples:
        return ["(empty profile)"]
    out = [f"{samples} active samples (py-spy --nonblocking: a thread waiting in epoll is not "
           f"sampled); event-loop thread {100 * stats['loop'][0] / samples:.0f}%, "
           f"other threads (storage workers: write + fdatasync) "
           f"{100 * stats['other'][0] / samples:.0f}%"]
    for which, title in (("loop", "event-loop thread"), ("other", "other threads")):
        count, own, total = stats[which]
        if not count:
            continue
        out.append(f"{title}: self% total% of its samples, by self")
        for fn, n in own.most_common(top if which == "loop" else 5):
            out.append(f"  {100 * n / count:5.1f} {100 * total[fn] / count:6.1f}  {fn}")
        if which == "loop":
            out.append(f"{title}: by total (inclusive), below the event loop")
            skip = {"Runner.run (asyncio/runners.py)", "run (uvloop/__init__.py)"}
            shown = 0
            for fn, n in total.most_common():
                if n == count or fn in skip:
                    continue
                out.append(f"  {100 * own[fn] / count:5.1f} {100 * n / count:6.1f}  {fn}")
                shown += 1
                if shown == top:
                    break
    return out


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
        self.sys0 = common._system_busy_seconds()
        self.self0 = cpu_seconds()

    def stop(self, client_cpu_s: float) -> None:
        self.wall = max(time.monotonic() - self.t0, 1e-9)
        self.server_cpus = (pid_cpu_seconds(self.pid) - self.server0) / self.wall
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
        specs.append({"kind": "consume", "groups": groups[i:i + k], "expected": expected,
                      "rdy": RDY, "max_s": max_s, "timeout_s": (max_s or 300) + 120})
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
        srv.create_channels(["c0"])
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
        srv.create_channels(names)
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


# =============================================================================

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller: under a minute")
    ap.add_argument("--only", default="a,b,c,d", help="parts to run, e.g. a,c (d needs c for its ratio)")
    ap.add_argument("--configs", default="durable,sync10000",
                    help="server configurations: durable (defaults), sync10000 (--sync-every 10000)")
    ap.add_argument("--procs", type=int, default=1,
                    help="load-generator processes for producers and for (d) (default 1: the "
                         "server needs one of the 2 CPUs)")
    ap.add_argument("--channel-consumers", type=int, default=1,
                    help="consumers per channel in (d) (default 1)")
    ap.add_argument("--backlog", type=int, help="backlog messages for (c) and (d)")
    ap.add_argument("--dir", help="temporary data paths inside DIR (default: the system temp dir)")
    ap.add_argument("--py-spy", metavar="DIR", help="record the server with py-spy during each "
                    "measured phase into DIR/<config>_<part>.txt and print a summary")
    ap.add_argument("--py-spy-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--py-spy-native", action="store_true",
                    help="py-spy --native (C frames too; pauses the server at each sample: slower)")
    args = ap.parse_args()
    P = dict(QUICK if args.quick else FULL)
    if args.backlog:
        P["backlog"] = args.backlog
    parts = set(args.only.split(","))
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}")

    report = Report("nsqd")
    load0 = os.getloadavg()
    t_start = time.monotonic()
    info = common.machine_info()
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
