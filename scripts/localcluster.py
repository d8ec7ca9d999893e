"""The README's run command: a local cluster on loopback, every process's data under one folder.

    .venv/bin/python scripts/localcluster.py [--data ./data] [--nsqd 3] [--lookupd 2] [--replicas 3]

Starts one etcd, the nsqlookupds, the nsqds (cluster mode, `--etcd-endpoints`), then
nsqadmin (the web UI, reading the nsqlookupds), prints where to look and what to try, and
runs until Ctrl-C or SIGTERM: then it stops nsqadmin, the nsqds (SIGTERM: they drain and
save their cursors), the nsqlookupds, then etcd, and exits 0 once
nothing it started is left running (a process that does not stop within its grace time
is killed).

Ports: the classic ones for the first process of each kind (nsqd 4150/4151, replication
4250; nsqlookupd 4160/4161; nsqadmin 4171; etcd 2379/2380), then the next free ones. The ports chosen are
kept in `<data>/cluster.json` and taken again on the next start when free, because a
node's id is its address: a restart keeps the cluster. `--free-ports` takes any free
ports instead of the classic ones (tests); the ports of the last run still come first.
`cluster.json` also lists each process's pid, for tools and tests.

A process that exits (a node killed to watch a failover) is reported with the command
that brings it back: `kill -HUP <launcher pid>` starts every exited process again, with
its data and ports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSIC = {"nsqd": (4150, 4151, 4250), "nsqlookupd": (4160, 4161), "nsqadmin": (4171,),
           "etcd": (2379, 2380)}
STOP_GRACE_S = {"nsqadmin": 10.0, "nsqd": 20.0, "nsqlookupd": 10.0, "etcd": 10.0}
START_TIMEOUT_S = 30.0


def bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Ports:
    """Hands out ports: the one a process had in the last run when it is free; else the
    classic one or the next free one above it (any free one with `any_free`)."""

    def __init__(self, any_free: bool):
        self.any_free = any_free
        self.taken: set[int] = set()

    def take(self, previous: int | None, classic: int) -> int:
        if previous and previous not in self.taken and bindable(previous):
            return self._taken(previous)
        port = classic
        while True:
            if self.any_free:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
            if port not in self.taken and bindable(port):
                return self._taken(port)
            port += 1

    def _taken(self, port: int) -> int:
        self.taken.add(port)
        return port


class Child:
    """One process of the cluster: how to start it and how to see that it serves."""

    def __init__(self, role: str, name: str, argv: list[str], health_url: str, log_path: str,
                 ports: dict[str, int]):
        self.role, self.name, self.argv = role, name, argv
        self.health_url, self.log_path, self.ports = health_url, log_path, ports
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            # its own process group: the terminal's Ctrl-C reaches only the launcher, which
            # stops the children in order
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=ROOT, start_new_session=True)

    def wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                                   f"its log: {self.log_path}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=1) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not serve within {START_TIMEOUT_S:g} s; "
                           f"its log: {self.log_path}\n{self.log_tail()}")

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
        """After terminate: wait its grace time, then kill."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.wait(STOP_GRACE_S[self.role])
        except subprocess.TimeoutExpired:
            print(f"{self.name} did not stop within {STOP_GRACE_S[self.role]:g} s: killed",
                  flush=True)
            self.proc.kill()
            self.proc.wait()

    def log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-2000:]
        except OSError:
            return ""


def plan(args) -> list[Child]:
    """The children in start order, on the ports of the last run when they are free."""
    data = os.path.abspath(args.data)
    logs = os.path.join(data, "logs")
    os.makedirs(logs, exist_ok=True)
    previous = {}
    try:
        with open(os.path.join(data, "cluster.json")) as f:
            previous = {p["name"]: p["ports"] for p in json.load(f)["processes"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ports = Ports(args.free_ports)

    def take(name: str, key: str, classic: int, index: int) -> int:
        return ports.take(previous.get(name, {}).get(key), classic + 2 * index)

    py = sys.executable
    etcd_bin = shutil.which("etcd")
    if etcd_bin is None:
        raise RuntimeError("etcd is not installed: run scripts/setup.sh")
    client = take("etcd", "client", CLASSIC["etcd"][0], 0)
    peer = take("etcd", "peer", CLASSIC["etcd"][1], 0)
    endpoint = f"http://127.0.0.1:{client}"
    children = [Child(
        "etcd", "etcd",
        [etcd_bin, "--name", "local", "--data-dir", os.path.join(data, "etcd"),
         "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"local=http://127.0.0.1:{peer}", "--max-txn-ops", "2048",
         "--log-level", "warn"],
        endpoint + "/health", os.path.join(logs, "etcd.log"), {"client": client, "peer": peer})]
    replicas = args.replicas or max(1, min(3, args.nsqd))
    cluster = ["--etcd-endpoints", endpoint, "--cluster-id", args.cluster_id,
               "--etcd-lease-ttl", args.etcd_lease_ttl, "--default-replicas", str(replicas)]
    for i in range(args.lookupd):
        name = f"nsqlookupd{i + 1}"
        tcp = take(name, "tcp", CLASSIC["nsqlookupd"][0], i)
        http = take(name, "http", CLASSIC["nsqlookupd"][1], i)
        children.append(Child(
            "nsqlookupd", name,
            [py, "-m", "nsqlookupd.main", "--tcp-address", f"127.0.0.1:{tcp}",
             "--http-address", f"127.0.0.1:{http}", "--broadcast-address", "127.0.0.1",
             *cluster],
            f"http://127.0.0.1:{http}/ping", os.path.join(logs, f"{name}.log"),
            {"tcp": tcp, "http": http}))
    for i in range(args.nsqd):
        name = f"nsqd{i + 1}"
        tcp = take(name, "tcp", CLASSIC["nsqd"][0], i)
        http = take(name, "http", CLASSIC["nsqd"][1], i)
        rpc = take(name, "rpc", CLASSIC["nsqd"][2], i)
        children.append(Child(
            "nsqd", name,
            [py, "-m", "nsqd.main", "--data-path", os.path.join(data, name),
             "--tcp-address", f"127.0.0.1:{tcp}", "--http-address", f"127.0.0.1:{http}",
             "--rpc-address", f"127.0.0.1:{rpc}", "--broadcast-address", "127.0.0.1",
             *cluster],
            f"http://127.0.0.1:{http}/ping", os.path.join(logs, f"{name}.log"),
            {"tcp": tcp, "http": http, "rpc": rpc}))
    admin = take("nsqadmin", "http", CLASSIC["nsqadmin"][0], 0)
    lookupds = [a for c in children if c.role == "nsqlookupd"
                for a in ("--lookupd-http-address", f"127.0.0.1:{c.ports['http']}")]
    children.append(Child(
        "nsqadmin", "nsqadmin",
        [py, "-m", "nsqadmin", "--http-address", f"127.0.0.1:{admin}", *lookupds],
        f"http://127.0.0.1:{admin}/ping", os.path.join(logs, "nsqadmin.log"), {"http": admin}))
    return children


def write_state(data: str, children: list[Child]) -> None:
    state = {"launcher_pid": os.getpid(), "processes": [
        {"role": c.role, "name": c.name, "pid": c.proc.pid if c.proc else None,
         "ports": c.ports, "log": c.log_path} for c in children]}
    path = os.path.join(data, "cluster.json")
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)


def master_http(lookupd_http: list[str]) -> str:
    """The master nsqlookupd's HTTP address (writes go there), once one is elected."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{lookupd_http[0]}/listlookup", timeout=1) as r:
                leader = json.loads(r.read()).get("lookupdleader")
            if leader:
                return f"{leader['NodeIP']}:{leader['HttpPort']}"
        except (OSError, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.1)
    return lookupd_http[0]


def wait_nodes_live(children: list[Child]) -> None:
    """Until every nsqlookupd lists every nsqd as live (its registration seen through etcd):
    a topic created right after the banner may ask for as many replicas as there are nodes."""
    nsqds = sum(1 for c in children if c.role == "nsqd")
    urls = [f"http://127.0.0.1:{c.ports['http']}/nodes" for c in children
            if c.role == "nsqlookupd"]
    deadline = time.monotonic() + START_TIMEOUT_S
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if len(json.loads(r.read()).get("producers") or []) >= nsqds:
                        break
            except (OSError, ValueError, AttributeError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not list the {nsqds} nsqd nodes within "
                                   f"{START_TIMEOUT_S:g} s")
            time.sleep(0.1)


def banner(args, children: list[Child]) -> str:
    by_role = {r: [c for c in children if c.role == r]
               for r in ("etcd", "nsqlookupd", "nsqd", "nsqadmin")}
    lookupd_http = [f"127.0.0.1:{c.ports['http']}" for c in by_role["nsqlookupd"]]
    master = master_http(lookupd_http)
    lines = ["local cluster running (Ctrl-C stops everything):",
             f"  etcd        http://127.0.0.1:{by_role['etcd'][0].ports['client']}"
             f"  (cluster id {args.cluster_id})"]
    for c in by_role["nsqlookupd"]:
        lines.append(f"  {c.name:<11} HTTP http://127.0.0.1:{c.ports['http']}  "
                     f"TCP 127.0.0.1:{c.ports['tcp']}")
    for c in by_role["nsqd"]:
        lines.append(f"  {c.name:<11} TCP 127.0.0.1:{c.ports['tcp']}  HTTP "
                     f"http://127.0.0.1:{c.ports['http']}  replication 127.0.0.1:{c.ports['rpc']}")
    for c in by_role["nsqadmin"]:
        lines.append(f"  {c.name:<11} http://127.0.0.1:{c.ports['http']}  (the web UI: "
                     "cluster, topics, partitions, channels, trace search)")
    first_nsqd = by_role["nsqd"][0].ports
    replicas = args.replicas or max(1, min(3, len(by_role["nsqd"])))
    lines += [
        f"  data and logs: {os.path.abspath(args.data)}  (process list: cluster.json)",
        "try:",
        f"  curl -X POST 'http://{master}/topic/create?topic=orders&partition_num=6"
        f"&replicator={replicas}'    (on the master nsqlookupd; each message on {replicas} "
        "nodes before its OK)",
        f"  curl 'http://{lookupd_http[-1]}/lookup?topic=orders'    (on any nsqlookupd)",
        f"  curl -d 'hello' 'http://127.0.0.1:{first_nsqd['http']}/pub?topic=events'"
        "    (auto-creates the topic)",
        f"  curl 'http://127.0.0.1:{first_nsqd['http']}/stats?format=json'",
        f"  consumers: any NSQ client with lookupd_http_addresses={lookupd_http}",
    ]
    return "\n".join(lines)


def restart_exited(started: list[Child], reported: set[str], data: str) -> None:
    """(SIGHUP) Start every process that exited again, with its data and ports: a node
    killed to watch a failover comes back and rejoins."""
    for child in started:
        if child.proc.poll() is None:
            continue
        child.start()
        write_state(data, started)
        try:
            child.wait_serving()
        except RuntimeError as e:
            print(f"{child.name} did not start again: {e}", flush=True)
            continue
        reported.discard(child.name)
        print(f"{child.name} started again", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="./data", help="the folder for every process's data")
    ap.add_argument("--nsqd", type=int, default=3, help="nsqd nodes (default 3)")
    ap.add_argument("--lookupd", type=int, default=2, help="nsqlookupd processes (default 2)")
    ap.add_argument("--cluster-id", default="nsq")
    ap.add_argument("--etcd-lease-ttl", default="5s")
    ap.add_argument("--replicas", type=int, default=None,
                    help="replicas of a topic created without saying (default: 3, or the "
                         "nsqd count when smaller)")
    ap.add_argument("--free-ports", action="store_true",
                    help="any free ports instead of the classic ones (tests)")
    args = ap.parse_args()
    if args.nsqd < 1 or args.lookupd < 1:
        ap.error("at least one nsqd and one nsqlookupd")

    stopping = False
    restart = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    def on_restart(signum, frame):
        nonlocal restart
        restart = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_restart)
    try:
        children = plan(args)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    started: list[Child] = []
    status = 0
    try:
        for child in children:
            if stopping:
                break
            child.start()
            started.append(child)
            write_state(args.data, children)
            child.wait_serving()
        if not stopping:
            wait_nodes_live(children)
            print(banner(args, children), flush=True)
        reported: set[str] = set()
        while not stopping:
            if restart:
                restart = False
                restart_exited(started, reported, args.data)
            for child in started:
                if child.proc.poll() is not None and child.name not in reported:
                    reported.add(child.name)
                    print(f"{child.name} exited with {child.proc.returncode} (log: "
                          f"{child.log_path}); the others keep running; start it again "
                          f"with: kill -HUP {os.getpid()}", flush=True)
            time.sleep(0.2)
    except RuntimeError as e:
        print(e, file=sys.stderr, flush=True)
        status = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for role in ("nsqadmin", "nsqd", "nsqlookupd", "etcd"):  # each kind at once, in order
            group = [c for c in started if c.role == role]
            for child in group:
                child.terminate()
            for child in group:
                child.wait_stopped()
        print("local cluster stopped", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
