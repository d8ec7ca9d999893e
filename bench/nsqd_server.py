"""The nsqd under test in bench/nsqd.py, and what is measured of it from outside.

`Server` is a fresh nsqd (tests/servers.py NsqdProcess, --log-level warning) on a fresh
temporary data path, removed at exit, with its VmRSS sampled every 100 ms from a thread
(`PidRssSampler`). `pid_rss_mb` and `pid_cpu_seconds` read /proc/PID. `Profiler` records the
server with py-spy during one phase; `summarize_profile` gives the top functions of a record.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

from bench import common
from bench.common import MB
from nsqwire.commands import FrameParser, cmd_sub
from nsqwire import protocol as p

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def thread_cpu(pid: int) -> dict[str, float]:
    """A process's CPU split by thread kind: the event loop's thread (the main one, whose
    id is the pid) and all the others (write and read workers, trace writer), each in user
    and system seconds, and the others' voluntary context switches (waits: a lock, the GIL,
    a queue). Threads gone since an earlier call take their time with them."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict(loop_user=0.0, loop_sys=0.0, threads_user=0.0, threads_sys=0.0,
               threads_switches=0.0)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches = next(int(line.split()[1]) for line in f
                                if line.startswith("voluntary_ctxt_switches:"))
        except (OSError, StopIteration):
            continue
        who = "loop" if tid == str(pid) else "threads"
        out[f"{who}_user"] += int(fields[11]) / tick
        out[f"{who}_sys"] += int(fields[12]) / tick
        if who == "threads":
            out["threads_switches"] += switches
    return out


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

    def create_channels(self, topic: str, names: list[str]) -> None:
        """SUB once to each channel and leave: the channels exist before the backlog is
        published (a channel made later starts at the end of the topic)."""
        for name in names:
            self.command(cmd_sub(topic, name))


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

