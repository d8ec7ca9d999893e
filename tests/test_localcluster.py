"""The README's run command (run.sh execs scripts/localcluster.py): a local cluster that
serves, stops cleanly on Ctrl-C with nothing left running, and keeps its data across a
restart. On free ports (`--free-ports`), so it never collides with a cluster running here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from cluster import http_json, wait_until
from servers import ROOT



def start(data: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "scripts", "localcluster.py"), "--data", data,
         "--free-ports", "--etcd-lease-ttl", "2s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the launcher ended: {''.join(lines)}")
        lines.append(line)
        if line.startswith("  consumers:"):
            return proc, lines
    raise AssertionError(f"no banner: {''.join(lines)}")


def pids(data: str) -> list[int]:
    with open(os.path.join(data, "cluster.json")) as f:
        return [p["pid"] for p in json.load(f)["processes"]]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by the launcher) is not running
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


def test_the_run_command_serves_stops_cleanly_and_keeps_the_cluster(tmp_path):
    data = str(tmp_path / "data")
    proc, lines = start(data)
    try:
        banner = "".join(lines)
        create = re.search(r"curl -X POST '(http://[^']+/topic/create)\?", banner).group(1)
        lookup = re.search(r"curl '(http://[^']+/lookup)\?", banner).group(1)
        pub = re.search(r"curl -d 'hello' '(http://[^']+/pub)\?", banner).group(1)
        assert len(re.findall(r"^  nsqd\d", banner, re.M)) == 3
        assert len(re.findall(r"^  nsqlookupd\d", banner, re.M)) == 2
        admin = re.search(r"^  nsqadmin +(http://\S+)", banner, re.M).group(1)

        status, body = http_json("POST", f"{create}?topic=orders&partition_num=6")
        assert status == 200, body
        answer = wait_until(lambda: http_json("GET", f"{lookup}?topic=orders")[1]
                            .get("partitions"), 5, "orders in /lookup")
        assert sorted(answer, key=int) == [str(n) for n in range(6)]
        assert len({p["tcp_port"] for p in answer.values()}) == 3  # spread over the 3 nodes
        with urllib.request.urlopen(urllib.request.Request(
                f"{pub}?topic=events", data=b"hello"), timeout=10) as r:
            assert r.read() == b"OK"
        children = pids(data)
        assert len(children) == 7 and all(alive(p) for p in children)

        def admin_shows_orders():
            status, body = http_json("GET", f"{admin}/api/topics")
            return status == 200 and "orders" in [t["name"] for t in body["topics"]]
        wait_until(admin_shows_orders, 15, "nsqadmin shows the topic")
    except BaseException:
        proc.kill()
        raise
    out = stop(proc)
    assert "local cluster stopped" in out
    assert not [p for p in children if alive(p)], "a process of the cluster still runs"

    proc, lines = start(data)  # the same data and ports: the same cluster
    try:
        lookup = re.search(r"curl '(http://[^']+/lookup)\?", "".join(lines)).group(1)

        def served_again():
            for topic, n in (("orders", 6), ("events", 2)):
                # every partition led again once all three nodes have registered again
                wait_until(lambda: len(http_json("GET", f"{lookup}?topic={topic}")[1]
                                       .get("partitions", {})) == n, 15, f"{topic} served")
        served_again()
        # a node killed -9 is reported with the command that brings it back, which does
        with open(os.path.join(data, "cluster.json")) as f:
            victim = [p for p in json.load(f)["processes"] if p["name"] == "nsqd2"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        line = proc.stdout.readline()
        assert line.startswith("nsqd2 exited with -9") and "kill -HUP" in line, line
        command = re.search(r"kill -HUP (\d+)", line)
        assert int(command.group(1)) == proc.pid
        os.kill(proc.pid, signal.SIGHUP)
        assert proc.stdout.readline() == "nsqd2 started again\n"
        assert victim["pid"] not in pids(data) and all(alive(p) for p in pids(data))
        served_again()
    finally:
        try:
            stop(proc)
        finally:
            left = kill_left(proc, data)
    assert not left


def kill_left(proc: subprocess.Popen, data: str) -> list[int]:
    """Kill what a failed run left running (the launcher, and the process group of each
    process it lists: they run in sessions of their own); return the pids that were."""
    if proc.poll() is None:
        proc.kill()
    try:
        left = [p for p in pids(data) if alive(p)]
    except FileNotFoundError:  # the launcher never wrote it
        return []
    for pid in left:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
