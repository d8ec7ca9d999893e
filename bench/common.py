"""Shared helpers for the benchmarks in bench/.

Conventions (see bench/README.md):
- a benchmark prints readable lines, then ends with exactly ONE line of JSON
  (`emit_json`) holding every figure, units in the key names
  (`..._msgs_per_s`, `..._ms`, `..._mb`, `..._bytes`, `..._s`);
- MB means MiB (2**20 bytes) everywhere, for throughput and RSS alike;
- a target is printed beside its figure as PASS or MISS, and repeated in the
  JSON under "targets" (name -> "PASS"/"MISS").
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import threading
import time

MB = 1 << 20


# ---- output ------------------------------------------------------------------

class Report:
    """Collects figures and target verdicts; prints readable lines as it goes."""

    def __init__(self, name: str):
        self.figures: dict = {"bench": name}
        self.targets: dict[str, str] = {}

    def section(self, title: str) -> None:
        print(f"\n== {title}", flush=True)

    def note(self, text: str) -> None:
        print(f"   {text}", flush=True)

    def add(self, key: str, value, label: str | None = None, fmt: str = ",.1f",
            target: tuple[str, bool] | None = None) -> None:
        """Record figure `key`; print `label: value` and, if given, `target` (text, ok)."""
        if isinstance(value, float):
            value = round(value, 3)
        self.figures[key] = value
        shown = format(value, fmt) if isinstance(value, (int, float)) and fmt else str(value)
        line = f"   {label or key:<44} {shown:>16}  [{key}]"
        if target is not None:
            text, ok = target
            verdict = "PASS" if ok else "MISS"
            self.targets[f"{key} {text}"] = verdict
            line += f"  target {text}: {verdict}"
        print(line, flush=True)

    def check(self, text: str, ok: bool) -> None:
        """A target that is not a single figure (e.g. 'RSS flat')."""
        verdict = "PASS" if ok else "MISS"
        self.targets[text] = verdict
        print(f"   target {text}: {verdict}", flush=True)

    def emit_json(self) -> None:
        out = dict(self.figures)
        out["targets"] = self.targets
        print(json.dumps(out, separators=(",", ":")), flush=True)


def emit_json(figures: dict) -> None:
    """Print one line of JSON (the last line a benchmark prints)."""
    print(json.dumps(figures, separators=(",", ":")), flush=True)


def machine_info() -> dict:
    load1, load5, _ = os.getloadavg()
    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "loadavg_1m": round(load1, 2), "loadavg_5m": round(load5, 2)}


# ---- statistics --------------------------------------------------------------

def percentile(sorted_values, p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of an already sorted sequence."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, int(round(p / 100 * len(sorted_values) + 0.5)) - 1))
    return sorted_values[k]


# ---- memory --------------------------------------------------------------------

def rss_mb() -> float:
    """Current resident set size of this process in MiB (VmRSS; page cache is not in it)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024 / MB
    except OSError:
        pass
    # Fallback: peak, not current (ru_maxrss is KiB on Linux, bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MB if sys.platform == "darwin" else peak * 1024 / MB


class RssSampler:
    """Samples RSS every `interval` seconds from a thread, so that a busy or blocked
    event loop does not skip samples. Use as a context manager; `samples` is a list
    of (seconds since start, MiB)."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = 0.0

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic() - self._t0, rss_mb()))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "RssSampler":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic() - self._t0, rss_mb()))

    @property
    def peak(self) -> float:
        return max(v for _, v in self.samples)

    def drift(self) -> float:
        """Median RSS of the last quarter of the samples minus that of the second quarter
        (the first quarter is warm-up): about 0 when memory is flat."""
        vals = [v for _, v in self.samples]
        n = len(vals)
        if n < 8:
            return vals[-1] - vals[0]
        q = n // 4
        second = sorted(vals[q:2 * q])
        last = sorted(vals[n - q:])
        return last[len(last) // 2] - second[len(second) // 2]


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class HistoryClock:
    """`with HistoryClock(steps, span_s):` every call of time.time_ns() in this process
    (the writer's timestamps: diskqueue's group commit takes one a batch) steps evenly from
    `span_s` ago to now, so records written in a few seconds span `span_s` and a search by
    time can land anywhere. Patches the `time` module itself, so compiled modules see it
    too; everything else of `time` is the real one."""

    def __init__(self, steps: int, span_s: int):
        self.now = time.time_ns()
        self.t = self.now - span_s * 10**9
        self.step = span_s * 10**9 // max(steps, 1)

    def time_ns(self) -> int:
        self.t = min(self.t + self.step, self.now)
        return self.t

    def __enter__(self) -> "HistoryClock":
        self._real = time.time_ns
        time.time_ns = self.time_ns
        return self

    def __exit__(self, *exc) -> None:
        time.time_ns = self._real


# ---- interference from other processes ----------------------------------------

def _system_busy_seconds() -> float | None:
    """CPU seconds all processes have been busy since boot (/proc/stat), None if unknown."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


class CpuWatch:
    """Measures, over a span, the CPUs this process used and the CPUs *other* processes
    used (system busy time minus ours, from /proc/stat): a noise indicator on a shared
    machine. `with CpuWatch() as w: ...` then `w.own_cpus`, `w.other_cpus`."""

    def __enter__(self) -> "CpuWatch":
        self._t0 = time.monotonic()
        self._own0 = _own_cpu_seconds()
        self._sys0 = _system_busy_seconds()
        return self

    def __exit__(self, *exc) -> None:
        wall = max(time.monotonic() - self._t0, 1e-9)
        own = _own_cpu_seconds() - self._own0
        self.wall = wall
        self.own_cpus = own / wall
        sys1 = _system_busy_seconds()
        if self._sys0 is None or sys1 is None:
            self.other_cpus = float("nan")
        else:
            self.other_cpus = max(0.0, (sys1 - self._sys0 - own) / wall)


# ---- garbage collector ------------------------------------------------------------

class GcWatch:
    """Time the cyclic garbage collector spends over a span, and its collections per
    generation: `with GcWatch() as g: ...` then `g.seconds`, `g.collections` ({0: n, 1: n, 2: n}),
    `g.longest` (the longest single collection, seconds)."""

    def __enter__(self) -> "GcWatch":
        import gc

        self._gc = gc
        self.seconds = 0.0
        self.longest = 0.0
        self.collections = {0: 0, 1: 0, 2: 0}
        self._t = 0.0
        gc.callbacks.append(self._callback)
        return self

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            spent = time.perf_counter() - self._t
            self.seconds += spent
            self.longest = max(self.longest, spent)
            self.collections[info["generation"]] += 1

    def __exit__(self, *exc) -> None:
        self._gc.callbacks.remove(self._callback)
