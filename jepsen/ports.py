"""Free loopback ports for daemons started later, outside the kernel's ephemeral range.

A port the kernel handed out for `bind(0)` and that we released lies in the ephemeral
range, so any outgoing connection may take it before our daemon listens on it (a full
test run lost to `address already in use` that way). Ports below that range are never
chosen for outgoing connections; the ones handed out here are remembered, so one process
never gets the same port twice. Each pytest-xdist worker hands out ports of its own slice
of the range: a node killed and started again on its ports found one taken by a daemon
another worker had just started there (a test run lost to `address already in use`).
"""

from __future__ import annotations

import os
import random
import socket

LOWEST = 10000
_given: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind host:port now (TIME_WAIT leftovers allowed)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _share() -> tuple[int, int]:
    """The lowest and highest port this process hands out: of LOWEST up to the ephemeral
    range, all of it, or a pytest-xdist worker's (gwN of PYTEST_XDIST_WORKER_COUNT) slice."""
    low, high = LOWEST, _ephemeral_low() - 1
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        size = (high - low + 1) // count
        low += int(worker[2:]) % count * size
        high = low + size - 1
    return low, high


def free_port() -> int:
    """A loopback port nobody listens on, below the ephemeral range, not given before by
    this process, in its share of the range."""
    low, high = _share()
    for _ in range(1000):
        port = random.randint(low, high)
        if port not in _given and bindable(port):
            _given.add(port)
            return port
    raise RuntimeError(f"no free port in {low}..{high}")
