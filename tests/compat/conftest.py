"""Fixtures of the client-compatibility suite: our real nsqd in a subprocess,
started with the flags a test needs (shared per module when the flags are the
same, since every test uses its own topic)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/compat/

from compat_util import make_self_signed_cert  # noqa: E402
from servers import NsqdProcess  # noqa: E402


class Servers:
    """Starts nsqd processes and kills every one of them at teardown."""

    def __init__(self, base: str):
        self.base = base
        self.procs: list[NsqdProcess] = []

    def start(self, *flags: str, name: str | None = None) -> NsqdProcess:
        path = os.path.join(self.base, name or f"nsqd{len(self.procs)}")
        proc = NsqdProcess(path, *flags)
        self.procs.append(proc)
        return proc.start()

    def close(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory):
    s = Servers(str(tmp_path_factory.mktemp("compat")))
    yield s
    s.close()


@pytest.fixture
def servers(tmp_path):
    s = Servers(str(tmp_path))
    yield s
    s.close()


@pytest.fixture(scope="module")
def shared_nsqd(module_servers):
    """Default flags (snappy and deflate on, msg timeout 60 s)."""
    return module_servers.start(name="default")


@pytest.fixture(scope="module")
def short_timeout_nsqd(module_servers):
    """--msg-timeout 1s: the server-wide default a client does not override."""
    return module_servers.start("--msg-timeout", "1s", name="short-timeout")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    return make_self_signed_cert(str(tmp_path_factory.mktemp("tls")))


@pytest.fixture(scope="module")
def tls_nsqd(module_servers, tls_files):
    cert, key = tls_files
    return module_servers.start("--tls-cert", cert, "--tls-key", key, name="tls")
