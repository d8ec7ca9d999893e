"""The `nsqd` command as a new user meets it: --version, classic single-dash flags, --help
with defaults, one clear line (never a traceback) for a port in use or a flag we refuse."""

import platform
import socket
import subprocess
import sys
import urllib.request

import pytest

from nsqd.options import from_args
from servers import ROOT, free_port


def run(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nsqd.main", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def one_line_error(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.mark.parametrize("flag", ["--version", "-version"])
def test_version(flag):
    r = run(flag)
    python = ".".join(platform.python_version_tuple()[:2])
    assert (r.returncode, r.stdout) == (0, f"nsqd v1.3.0 (durable-nsq 0.1.0, python {python})\n")


def test_single_and_double_dash_flags_with_equals_or_space():
    """Go's flag package: -flag and --flag, each with =value or a separate value."""
    o = from_args(["-tcp-address=127.0.0.1:1", "-http-address", "127.0.0.1:2",
                   "--msg-timeout=30s", "--max-rdy-count", "7", "-snappy=false",
                   "-tls-required", "-data-path", "-odd-folder-name"])
    assert (o.tcp_address, o.http_address) == ("127.0.0.1:1", "127.0.0.1:2")
    assert (o.msg_timeout_ms, o.max_rdy_count, o.snappy, o.tls_required) == (30_000, 7, False, 1)
    assert o.data_path == "-odd-folder-name", "a value is never taken for a flag"


def until_ping(proc: subprocess.Popen, http: int) -> None:
    """Wait until the started nsqd answers /ping (it must not exit meanwhile)."""
    for _ in range(200):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/ping", timeout=1) as r:
                assert r.read() == b"OK"
                return
        except OSError:
            assert proc.poll() is None, proc.stderr.read()
            subprocess.run(["sleep", "0.05"])
    raise AssertionError("nsqd did not start")


def test_a_node_starts_with_single_dash_flags(tmp_path):
    tcp, http = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nsqd.main", f"-tcp-address=127.0.0.1:{tcp}",
                             "-http-address", f"127.0.0.1:{http}", f"-data-path={tmp_path}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        until_ping(proc, http)
    finally:
        proc.kill()
        proc.wait()


def test_unknown_flags_are_refused_in_either_form():
    for argv in (["-no-such-flag=1"], ["--no-such-flag", "1"], ["--tcp", "127.0.0.1:1"]):
        r = run(*argv)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r
        assert "unrecognized arguments" in r.stderr, r.stderr


def test_help_shows_defaults():
    r = run("--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for expected in ("(default \"0.0.0.0:4150\")", "(default \"0.0.0.0:4151\")", "(default 1m0s)",
                     "(default 72h0m0s)", "(default 2500)", "(default true)", "(default 1)",
                     "--version"):
        assert expected in text, expected


@pytest.mark.parametrize("listener", ["tcp", "http"])
def test_a_port_in_use_is_one_line(tmp_path, listener):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        free = f"127.0.0.1:{free_port()}"
        tcp, http = (taken, free) if listener == "tcp" else (free, taken)
        r = run("--tcp-address", tcp, "--http-address", http, "--data-path", str(tmp_path))
    one_line_error(r, 1, taken, f"--{listener}-address", "address already in use")


def test_lookupd_address_is_repeatable_as_classic(tmp_path):
    """`--lookupd-tcp-address` may be given several times, in either spelling, and the
    classic config key names the same list (the node registers with each: nsqd/lookup.py)."""
    o = from_args(["--lookupd-tcp-address", "127.0.0.1:4160", "-lookupd-tcp-address=10.0.0.2:4160"])
    assert o.lookupd_tcp_address == ["127.0.0.1:4160", "10.0.0.2:4160"]
    config = tmp_path / "nsqd.toml"
    config.write_text('nsqlookupd_tcp_addresses = ["127.0.0.1:4160"]\n')
    assert from_args(["--config", str(config)]).lookupd_tcp_address == ["127.0.0.1:4160"]
    r = run("--help")
    assert "lookupd TCP address (may be given multiple times)" in " ".join(r.stdout.split())
    o = from_args(["--lookupd-tcp-address=[::1]:4160", "--lookupd-tcp-address=lookupd1:4160"])
    assert o.lookupd_tcp_address == ["[::1]:4160", "lookupd1:4160"]


@pytest.mark.parametrize("address", ["foo", "foo:", "foo:bar", "foo:70000", "[::1", "::1:4160"])
def test_a_bad_lookupd_address_is_refused_at_start(tmp_path, address):
    """A typo in an nsqlookupd address is one line and exit 2, not a traceback, nor a
    node that dials it in vain."""
    r = run("--lookupd-tcp-address", address, "--data-path", str(tmp_path))
    one_line_error(r, 2, "invalid nsqlookupd address", repr(address))


def test_a_node_raises_its_open_files_limit_to_the_hard_one(tmp_path):
    """Started with a soft limit of 256 open files, nsqd runs with the hard limit."""
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    tcp, http = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nsqd.main", f"--tcp-address=127.0.0.1:{tcp}",
                             f"--http-address=127.0.0.1:{http}", f"--data-path={tmp_path}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                  (256, hard)))
    try:
        until_ping(proc, http)
        with open(f"/proc/{proc.pid}/limits") as f:
            (line,) = [x for x in f if x.startswith("Max open files")]
        assert line.split()[3:5] == [str(hard), str(hard)]
    finally:
        proc.kill()
        proc.wait()


async def test_a_burst_to_more_partitions_than_descriptors_allow_is_all_answered_ok(tmp_path):
    """A node with 200 descriptors (hard limit: it cannot raise it) takes one PUB to each
    of 1,000 partitions at once, over 4 connections: every one is answered OK, the logs
    beyond its FileBudget having waited for a place (without it: E_PUB_FAILED, Too many
    open files), and the data is all there; killed (-9) and started again, its journal's
    replay (1,000 segments) stays within the limit, and the data is still there."""
    import asyncio
    import json
    import resource
    import time

    from nsqwire import protocol as p
    from nsqwire.commands import FrameParser, cmd_pub

    tcp, http = free_port(), free_port()

    log_path = tmp_path / "nsqd.log"

    def start() -> subprocess.Popen:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "nsqd.main", f"--tcp-address=127.0.0.1:{tcp}",
                 f"--http-address=127.0.0.1:{http}", f"--data-path={tmp_path}"],
                stdout=log, stderr=log, cwd=ROOT,
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)))
        for _ in range(300):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                request("/ping", "GET")
                return proc
            except OSError:
                time.sleep(0.05)
        raise AssertionError("nsqd did not start")

    def committed() -> dict[int, int]:
        stats = json.loads(request("/stats?format=json", "GET"))
        return {part["partition"]: part["committed_count"]
                for part in stats["topics"][0]["partitions"]}

    def request(path: str, method: str = "POST") -> bytes:
        req = urllib.request.Request(f"http://127.0.0.1:{http}{path}", method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read()

    async def publish(share: list[int]) -> list[bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", tcp)
        writer.write(p.MAGIC_V2 + b"".join(cmd_pub("t", b"m%d" % i, i) for i in share))
        frames, answers = FrameParser(), []
        while len(answers) < len(share):
            chunk = await reader.read(1 << 16)
            assert chunk, f"closed after {len(answers)} answers"
            frames.feed(chunk)
            answers += [data for kind, data in frames.frames() if kind != p.FRAME_MESSAGE]
        writer.close()
        return answers

    proc = start()
    try:
        request("/topic/create?topic=t&partition_num=1000")
        request("/channel/create?topic=t&channel=c")
        parts = list(range(1000))
        answers = await asyncio.wait_for(
            asyncio.gather(*(publish(parts[i::4]) for i in range(4))), 60)
        assert [a for share in answers for a in share] == [b"OK"] * 1000
        stats = json.loads(request("/stats?format=json", "GET"))
        budget = stats["file_budget"]
        assert budget["limit"] == 200 // 6 and budget["held"] <= budget["limit"]
        assert budget["waits"] > 0
        assert committed() == {i: 1 for i in parts}
        assert stats["topics"][0]["channels"][0]["depth"] == 1000
        proc.kill()
        proc.wait()
        proc = start()
        assert committed() == {i: 1 for i in parts}
    finally:
        proc.kill()
        proc.wait()


async def test_the_start_runs_under_the_gc_policy(tmp_path, monkeypatch):
    """`serve` applies diskqueue.runtime's policy before the node's start, not only after:
    at the default thresholds a start of 10,000 partitions spent 2.2 s collecting."""
    import gc

    from diskqueue.runtime import SWITCH_INTERVAL_S
    from nsqd import main

    seen = {}

    class Node:
        async def start(self):
            seen.update(threshold=gc.get_threshold(), switch=sys.getswitchinterval())
            raise RuntimeError("started")

    threshold, switch = gc.get_threshold(), sys.getswitchinterval()
    monkeypatch.setattr(main, "build", lambda options: Node())
    try:
        with pytest.raises(RuntimeError, match="started"):
            await main.serve(from_args(["--data-path", str(tmp_path)]))
    finally:
        gc.set_threshold(*threshold)
        sys.setswitchinterval(switch)
        gc.unfreeze()
    assert seen["threshold"] == (50_000, 50, 100)
    assert seen["switch"] == pytest.approx(SWITCH_INTERVAL_S)
