"""Every command block of README.md runs as written, and says what the README says.

Blocks are the README's indented code blocks; a line ending in `\\` goes on in the next.
Each section (a `##` or `###` heading) is one scene, run in order in one scratch folder:
- in a section of RUN_SH_SECTIONS, what `./run.sh` starts runs first: the launcher
  (scripts/localcluster.py) on free ports, stopped with Ctrl-C (SIGINT, exit 0) at the end;
- a daemon (`nsqd`, `nsqlookupd`, `nsqadmin` without `--version`/`--help`) starts in the
  background and serves its `--http-address` before the next command; at the end of the
  section it gets SIGTERM and must exit 0;
- any other command runs in the foreground and CHECKS has its check: exit status and
  output. A curl whose check fails runs again for up to RETRY_S: the README's reads show a
  state the cluster reaches moments after the command before (a registration, a leader,
  nsqadmin's next poll).
Only this is changed in a command before it runs: `/tmp/` is the scratch folder,
`.venv/bin/` the virtualenv running this test, and each `127.0.0.1:PORT` (or bash's
`/dev/tcp/127.0.0.1/PORT`) the port standing for that classic one (the launcher's, from its cluster.json; else a free port of the
section). Nothing a command or daemon starts may listen beyond loopback.

A command with neither a check nor an EXCLUDED entry fails the test, as do a check or an
exclusion that no command uses: a command added to the README is run or excluded by name.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

from cluster import wait_until
from servers import ROOT, free_port

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from localcluster import CLASSIC  # noqa: E402

BIN = os.path.dirname(sys.executable)
RUN_SH_SECTIONS = {"Trying the local cluster"}
# the launcher's port keys in the order of localcluster.CLASSIC's ports
PORT_KEYS = {"nsqd": ("tcp", "http", "rpc"), "nsqlookupd": ("tcp", "http"),
             "nsqadmin": ("http",), "etcd": ("client", "peer")}
EXCLUDED = {  # command prefix: why it does not run here
    "./run.sh": "installs (scripts/setup.sh --run) and runs until Ctrl-C; RUN_SH_SECTIONS "
                "start what it execs, scripts/localcluster.py",
    "./test.sh": "installs everything and runs the whole suite, this test among it",
    ".venv/bin/python bench/": "17 benchmarks, together minutes even with --quick; "
                               "bench/README.md gives their runs",
}
DAEMONS = {"nsqd", "nsqlookupd", "nsqadmin"}
RETRY_S = 15.0


# ---- the README's commands --------------------------------------------------------------


def sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, commands) in README order; continued lines joined into one command."""
    out: list[tuple[str, list[str]]] = [("", [])]
    in_block, previous = False, ""
    for line in text.splitlines():
        if line.startswith("#"):
            out.append((line.lstrip("#").strip(), []))
            in_block = False
        elif line.startswith("    ") and (in_block or not previous.strip()):
            in_block = True
            commands = out[-1][1]
            if commands and commands[-1].endswith("\\"):
                commands[-1] = commands[-1][:-1] + line.strip()
            else:
                commands.append(line.strip())
        elif line.strip():
            in_block = False
        previous = line
    return [(h, cs) for h, cs in out if cs]


def is_daemon(command: str) -> bool:
    argv = shlex.split(command, comments=True)
    return os.path.basename(argv[0]) in DAEMONS and not {"--version", "--help"} & set(argv)


def flag(command: str, name: str) -> str:
    m = re.search(rf"(?:^|\s)--?{name}[= ](\S+)", command)
    assert m, f"{command!r}: give it --{name} (the test cannot know where it serves)"
    return m.group(1)


# ---- processes and their listening sockets ----------------------------------------------


def process_tree(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += children.get(p, [])
    return tree


def listening(pid: int) -> set[tuple[str, bool]]:
    """(local address in /proc/net hex, is loopback) of every TCP socket the process and
    its descendants listen on."""
    inodes = set()
    for p in process_tree(pid):
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                target = os.readlink(f"/proc/{p}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    found.add((cols[1], is_loopback(cols[1].rsplit(":", 1)[0])))
    return found


def is_loopback(address: str) -> bool:
    """/proc/net/tcp{,6} print an address as 32-bit words in host (little-endian) order:
    127.x.y.z ends in 7F, as ::ffff:127.x.y.z does; ::1 is 24 zeros and 01000000."""
    if len(address) == 8:
        return address.endswith("7F")
    return (address.startswith("0000000000000000FFFF0000") and address.endswith("7F")) or \
        address == "0" * 24 + "01000000"


def tail(log: str) -> str:
    with open(log, errors="replace") as f:
        return f.read()[-3000:]


# ---- checks -----------------------------------------------------------------------------


class Ran:
    """A foreground command's run: what the checks read."""

    def __init__(self, scratch: str, status: int, out: str, err: str, listeners: set):
        self.scratch, self.status, self.out, self.err = scratch, status, out, err
        self.listeners = listeners  # what it and its children listened on, as listening()

    def json(self):
        return json.loads(self.out)


def check_replay(r: Ran) -> bool:
    import pyarrow.parquet as pq

    assert r.status == 0, r.err[-3000:]
    assert json.loads(r.out.strip().splitlines()[-1])["rows"] == 1  # the one message published
    table = pq.read_table(os.path.join(r.scratch, "events-last-hour"))
    assert table.column("body").to_pylist() == [b"hello"]
    assert table.column("topic").to_pylist() == ["events"]
    assert r.listeners, "Spark's JVM listened on nothing: nothing was checked"
    return True


CHECKS = {  # a regex on the command as the README has it: what its run must show
    r"\.venv/bin/nsqd --version\b":
        lambda r: r.status == 0 and r.out.startswith("nsqd v1.3.0 (durable-nsq "),
    r"\.venv/bin/nsqd --help\b":
        lambda r: r.status == 0 and "--data-path" in r.out and "--lookupd-tcp-address" in r.out,
    r"curl -d 'hello' '\S+/pub\?topic=\w+'": lambda r: r.status == 0 and r.out == "OK",
    r"curl '\S+/stats\?format=json'":
        lambda r: r.status == 0 and any(t["topic_name"] == "test" and t["message_count"] == 1
                                        for t in r.json()["topics"]),
    r"curl '\S+/lookup\?topic=events'":  # cluster mode: every partition with its leader
        lambda r: r.status == 0 and r.json()["partitions"] and all(
            p["tcp_port"] for p in r.json()["partitions"].values()),
    r"curl '\S+/lookup\?topic=test'":  # classic: the node that registered the topic
        lambda r: r.status == 0 and len(r.json()["producers"]) == 1,
    r"curl '\S+/api/topics/events'":
        lambda r: r.status == 0 and r.json()["name"] == "events" and r.json()["messages"] == 1
        and r.json()["partitions"],
    r"\.venv/bin/python -m spark\.replay .*--since -1h": check_replay,
    r"\.venv/bin/python -c 'import secrets":
        lambda r: r.status == 0 and len(open(os.path.join(r.scratch, "admin.secret")).read()
                                        .strip()) == 64,
    r"curl -X POST '\S+/topic/create\?topic=test'":  # without the key: refused
        lambda r: r.status == 0 and r.json() == {"message": "ADMIN_KEY_REQUIRED"},
    r"curl -X POST -H \"Authorization: Bearer ":  # with it: made
        lambda r: r.status == 0 and "message" not in r.out,
    r"curl -d 'debit 42' '\S+/pub\?topic=pay&producer_id=till-7&sequence=0'":  # and again
        lambda r: r.status == 0 and r.out == "OK",
    r"curl -d 'debit 43' '\S+&sequence=5'":  # a gap: refused, nothing written
        lambda r: r.status == 0 and r.json() == {"message": "BAD_SEQUENCE"},
    r"curl '\S+/stats\?format=json&topic=pay'":  # the retry written once
        lambda r: r.status == 0 and [(t["message_count"], t["partitions"][0]["producers"],
                                      t["partitions"][0]["producer_duplicates"])
                                     for t in r.json()["topics"]] == [(1, 1, 1)],
    r"curl -d 'order 7' '\S+/pub\?topic=orders'": lambda r: r.status == 0 and r.out == "OK",
    r"curl -X POST '\S+/channel/create\?topic=orders&channel=billing'":
        lambda r: r.status == 0 and r.out == "",
    r"curl -X POST '\S+/channel/config\?topic=orders&channel=billing&max_attempts=1'":
        lambda r: r.status == 0 and r.json() == {"max_attempts": 1},
    r"bash -c 'exec 3<>/dev/tcp/": lambda r: r.status == 0,  # a consumer that dies
    r"curl '\S+/channel/dead\?topic=orders&channel=billing'":  # buried: its client left
        lambda r: r.status == 0 and [(d["body"], d["attempts"], d["cause"])
                                     for d in r.json()["dead_letters"]] == [("order 7", 1,
                                                                              "closed")],
    r"curl -X POST '\S+/channel/dead/requeue\?topic=orders&channel=billing'":
        lambda r: r.status == 0 and r.json() == {"count": 1},
    r"curl -d 'debit 42' '\S+/half\?topic=pay&check_url=":  # the partition's first record
        lambda r: r.status == 0 and r.json() == {"id": "0000000000000000", "partition": 0},
    r"curl -X POST '\S+/half/commit\?topic=pay&id=0000000000000000'":
        lambda r: r.status == 0 and r.json() == {"state": "committed"},
    r"curl -d 'debit 43' '\S+/half\?topic=pay&check_url=":
        lambda r: r.status == 0 and r.json()["partition"] == 0,
    r"curl '\S+/half\?topic=pay'":  # checked back once, no answer: rolled back
        lambda r: r.status == 0 and [(p["waiting"], p["committed"], p["rolled_back"],
                                      p["checks"], p["expired"])
                                     for p in r.json()["partitions"]] == [([], 1, 1, 1, 1)],
}


def what_of(command: str) -> str:
    """The command's EXCLUDED prefix, "daemon", or its key in CHECKS."""
    prefix = next((p for p in EXCLUDED if command.startswith(p)), None)
    if prefix or is_daemon(command):
        return prefix or "daemon"
    found = [c for c in CHECKS if re.match(c, command)]
    assert len(found) == 1, f"README command {command!r} has {len(found)} checks in CHECKS"
    return found[0]


def passes(check, ran: Ran) -> bool:
    """Whether the check returns a true value; what it raised goes into ran.err."""
    try:
        return check(ran) not in (False, None, [], {})
    except (AssertionError, ValueError, KeyError, TypeError) as e:
        ran.err += f"\n(check: {e!r})"
        return False


# ---- a section --------------------------------------------------------------------------


class Scene:
    """One section's run: its ports, and what it started in the background."""

    def __init__(self, scratch: str, env: dict):
        self.scratch, self.env = scratch, env
        self.ports: dict[int, int] = {}
        self.fixed_ports = False  # the launcher's ports: a classic port it lacks is an error
        self.started: list[tuple[subprocess.Popen, str, int, str]] = []  # proc, what, signal, log

    def as_run(self, command: str) -> str:
        command = command.replace("/tmp/", self.scratch + "/").replace(".venv/bin/", BIN + "/")

        def port(m: re.Match) -> str:
            classic = int(m.group(2))
            if classic not in self.ports:
                assert not self.fixed_ports, f"{command!r}: the launcher has no port {classic}"
                self.ports[classic] = free_port()
            return f"127.0.0.1{m.group(1)}{self.ports[classic]}"

        return re.sub(r"127\.0\.0\.1([:/])(\d+)", port, command)

    def background(self, argv: list[str], name: str, stop_with: int) -> subprocess.Popen:
        log = os.path.join(self.scratch, f"{name}-{len(self.started)}.log")
        with open(log, "wb") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=self.scratch,
                                    env=self.env)
        self.started.append((proc, name, stop_with, log))
        return proc

    def start_launcher(self) -> None:
        data = os.path.join(self.scratch, "launcher")
        proc = self.background([sys.executable, os.path.join(ROOT, "scripts", "localcluster.py"),
                                "--data", data, "--free-ports"], "localcluster", signal.SIGINT)
        log = self.started[-1][3]

        def banner():
            assert proc.poll() is None, f"the launcher exited: {tail(log)}"
            return "  consumers:" in tail(log)

        wait_until(banner, 90, "the launcher's banner", 0.2)
        with open(os.path.join(data, "cluster.json")) as f:
            processes = json.load(f)["processes"]
        for p in processes:
            index = int(re.sub(r"\D", "", p["name"]) or 1) - 1
            for key, classic in zip(PORT_KEYS[p["role"]], CLASSIC[p["role"]]):
                self.ports[classic + 2 * index] = p["ports"][key]
        self.fixed_ports = True

    def start_daemon(self, command: str) -> None:
        http = flag(command, "http-address")
        proc = self.background(["bash", "-c", "exec " + command], command.split()[0],
                               signal.SIGTERM)
        log = self.started[-1][3]

        def serving():
            assert proc.poll() is None, f"{command!r} exited: {tail(log)}"
            try:
                with urllib.request.urlopen(f"http://{http}/ping", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(serving, 30, f"{command!r} serving", 0.1)

    def run(self, command: str, check) -> Ran:
        deadline = time.monotonic() + RETRY_S
        while True:
            out, err = (os.path.join(self.scratch, f"command.{n}") for n in ("out", "err"))
            with open(out, "wb") as o, open(err, "wb") as e:  # files: a pipe could fill up
                proc = subprocess.Popen(["bash", "-c", command], cwd=self.scratch,
                                        env=self.env, stdout=o, stderr=e)
            listeners: set = set()
            while proc.poll() is None:
                listeners |= listening(proc.pid)
                time.sleep(0.2)
            with open(out, errors="replace") as o, open(err, errors="replace") as e:
                ran = Ran(self.scratch, proc.returncode, o.read(), e.read(), listeners)
            if passes(check, ran) or not command.startswith("curl ") or \
                    time.monotonic() > deadline:
                return ran
            time.sleep(0.3)

    def stop_all(self) -> list[str]:
        """Stops everything started, last first: what did not exit 0."""
        failures = []
        while self.started:
            proc, what, how, log = self.started.pop()
            if proc.poll() is None:
                proc.send_signal(how)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.returncode != 0:
                failures.append(f"{what} exited {proc.returncode}:\n{tail(log)}")
        return failures


# ---- the test ---------------------------------------------------------------------------


def test_the_readme_parses_into_its_sections():
    with open(os.path.join(ROOT, "README.md")) as f:
        found = dict(sections(f.read()))
    assert found["The two commands"] == [
        "./run.sh     # set everything up, start a local cluster with its data in ./data",
        "./test.sh    # set everything up, run the whole test suite"]
    assert RUN_SH_SECTIONS <= set(found)
    replay = (".venv/bin/python -m spark.replay --lookupd 127.0.0.1:4161 --topic events "
              "--since -1h --to parquet:/tmp/events-last-hour --mode overwrite     "
              "# the last hour into Parquet")
    assert [c for c in found["Trying the local cluster"] if "spark.replay" in c] == [replay]


def test_every_readme_command_runs_as_written(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        scenes = sections(f.read())
    used = {what_of(c) for _, commands in scenes for c in commands}
    assert set(EXCLUDED) <= used, f"excluded, but in no command: {set(EXCLUDED) - used}"
    assert set(CHECKS) <= used, f"checks no command uses: {set(CHECKS) - used}"

    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LOCAL_IP", "PYSPARK_PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    failures = []
    for heading, commands in scenes:
        scene = Scene(str(tmp_path), env)
        try:
            if heading in RUN_SH_SECTIONS:
                scene.start_launcher()
            for command in commands:
                what = what_of(command)
                if what in EXCLUDED:
                    continue
                if what == "daemon":
                    scene.start_daemon(scene.as_run(command))
                    continue
                r = scene.run(scene.as_run(command), CHECKS[what])
                if not passes(CHECKS[what], r):
                    failures.append(f"{command}\n  exit {r.status}\n  out: {r.out[-2000:]}\n"
                                    f"  err: {r.err[-3000:]}")
                beyond = [a for a, loopback in r.listeners if not loopback]
                if beyond:
                    failures.append(f"{command}: listened beyond loopback on {beyond}")
            for proc, what, _, _ in scene.started:
                beyond = [a for a, loopback in listening(proc.pid) if not loopback]
                if beyond:
                    failures.append(f"{what}: listens beyond loopback on {beyond}")
        finally:
            failures += scene.stop_all()
    assert not failures, "\n\n".join(failures)
