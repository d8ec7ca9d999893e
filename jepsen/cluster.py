"""The cluster under test: N hosts, each with an etcd member (one real N-member etcd
cluster), an nsqd, and on the first `lookupds` hosts an nsqlookupd.

Two kinds of host:
- `NetnsCluster` (root): each host is a network namespace `jep-nI` with address
  10.213.0.I on the bridge `jep-br0` (a veth pair each); the harness runs in the root
  namespace at 10.213.0.254 and reaches every host. Partitions are iptables DROP rules
  inside the hosts' namespaces, so they never touch the harness's own traffic.
  Each nsqd's data path is a small tmpfs of its own (`--disk-mb`, source `jep-nI`), which
  the disk-full nemesis fills; or, when the power-cut nemesis runs (`powerfs=True`), a
  PowerFS mount (tests/powerfs.py, FUSE, source `jep-nI`) that loses what was not synced
  when `power_cut()` cuts it. etcd's data stays on the normal disk either way.
- `LoopbackCluster` (no root): the same processes on 127.0.0.1 with their own ports, every
  advertised port a user-space relay (jepsen/proxy.py) that partitions stall. It cannot
  fill a disk or cut the power (no namespaces, no mounts): the process nemeses and
  partitions run there.

Invariant: whatever happens (an exception, Ctrl-C, SIGTERM), `teardown()` leaves no
process, namespace, veth, bridge or mount (tmpfs or PowerFS) behind; `cleanup_leftovers()`
removes those of an earlier run that could not (every name starts with `jep-`), even one
whose harness was SIGKILLed: every daemon (and PowerFS process) carries `JEPSEN_DAEMON`
in its environment, so it is found wherever it runs, and another harness still running is
stopped first (it would restart its daemons). iptables rules live inside the namespaces and die with them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from jepsen.ports import free_port
from jepsen.proxy import Relays

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "jep-"
BRIDGE = PREFIX + "br0"
SUBNET = "10.213.0"
HARNESS_IP = f"{SUBNET}.254"
CLUSTER_ID = "jepsen"
MARK = "JEPSEN_DAEMON"  # in the environment of every daemon a harness starts


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def http_json(method: str, url: str, timeout: float = 2) -> tuple[int, object]:
    """(status, JSON body); an HTTP error status is returned, a network error raised."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, None


class Daemon:
    """One process of one host, restartable with the same argv (and data)."""

    def __init__(self, host: "Host", role: str, argv: list[str], health_url: str):
        self.host, self.role, self.argv, self.health_url = host, role, argv, health_url
        self.log_path = os.path.join(host.cluster.logs, f"{host.name}-{role}.log")
        self.proc: subprocess.Popen | None = None
        self.paused = False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            # its own session: a Ctrl-C reaches the harness only, which stops everything
            self.proc = subprocess.Popen(self.host.wrap(self.argv), stdout=log,
                                         stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True,
                                         env={**os.environ, MARK: self.host.cluster.store})
        self.paused = False

    def wait_serving(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.host.name} {self.role} exited with "
                                   f"{self.proc.returncode}: see {self.log_path}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=1):
                    return
            except urllib.error.HTTPError:
                if self.role == "nsqd":  # an unhealthy answer: it is up
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.host.name} {self.role} did not serve in {timeout:g} s")

    def signal(self, signum: int) -> None:
        if self.running:
            os.kill(self.proc.pid, signum)
            if signum == signal.SIGSTOP:
                self.paused = True
            elif signum == signal.SIGCONT:
                self.paused = False

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (nsqd drains, syncs and exits 0) and reap; SIGKILL after `timeout`.
        Returns the exit status (None: it had to be killed, or was never started)."""
        if self.proc is None:
            return None
        if not self.running:
            return self.proc.returncode
        if self.paused:
            self.signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL and reap (a paused process dies as well)."""
        if self.running:
            self.proc.kill()
            self.proc.wait()
        self.paused = False


class Host:
    def __init__(self, cluster: "Cluster", index: int, ip: str, ports: dict[str, int]):
        self.cluster, self.index, self.ip, self.ports = cluster, index, ip, ports
        self.listen = ports  # where the daemons listen: `ports` (advertised) but on loopback
        self.name = f"n{index}"
        self.daemons: dict[str, Daemon] = {}

    def wrap(self, argv: list[str]) -> list[str]:
        return argv

    def broadcast_ports(self, *pairs: tuple[str, str]) -> list[str]:
        """`--broadcast-<flag>-port <advertised>` for each port listened on elsewhere."""
        return [arg for key, flag in pairs if self.listen[key] != self.ports[key]
                for arg in (f"--broadcast-{flag}-port", str(self.ports[key]))]

    @property
    def etcd_peer(self) -> str:
        return f"http://{self.ip}:{self.ports['etcd_peer']}"

    @property
    def etcd_client(self) -> str:
        return f"http://{self.ip}:{self.ports['etcd']}"

    @property
    def nsqd_tcp(self) -> str:
        return f"{self.ip}:{self.ports['nsqd_tcp']}"

    @property
    def nsqd_http(self) -> str:
        return f"{self.ip}:{self.ports['nsqd_http']}"

    @property
    def lookupd_http(self) -> str:
        return f"{self.ip}:{self.ports['lookupd_http']}"


class NetnsHost(Host):
    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.name}"

    def wrap(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]  # ip execs: the pid is argv's


class Cluster:
    """The hosts and their daemons; `setup()` starts everything, `teardown()` stops it."""

    host_class = Host
    harness_ip = "127.0.0.1"  # where the hosts reach the harness (the check-back server)
    can_partition = False
    can_fill_disk = False
    can_power_cut = False

    def __init__(self, store: str, nodes: int = 5, lookupds: int = 3,
                 nsqd_flags: tuple[str, ...] = (), lease_ttl: str = "2s", disk_mb: int = 64,
                 powerfs: bool = False, clock_skew: bool = False):
        self.store = store
        self.clock_skew = clock_skew  # every nsqd under libfaketime (clock_file, set_clock)
        self.disk_mb = disk_mb
        self.powerfs = powerfs  # nsqd's data on PowerFS (network namespaces only)
        self.logs = os.path.join(store, "logs")
        self.data = os.path.join(store, "data")
        self.nsqd_flags = list(nsqd_flags)
        self.lease_ttl = lease_ttl
        self.hosts = [self.host_class(self, i + 1, self.ip_of(i + 1), self.ports_of(i + 1))
                      for i in range(nodes)]
        self.lookupd_hosts = self.hosts[:max(1, min(lookupds, nodes))]

    def ip_of(self, index: int) -> str:
        raise NotImplementedError

    def ports_of(self, index: int) -> dict[str, int]:
        raise NotImplementedError

    # ---- life ----------------------------------------------------------------------

    def setup(self) -> None:
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(self.data, exist_ok=True)
        if self.clock_skew:
            self._faketime_lib = faketime_library()
            for h in self.hosts:
                self.set_clock(h, 0.0)
        etcd_bin = shutil.which("etcd")
        if etcd_bin is None:
            raise RuntimeError("etcd is not installed: run scripts/setup.sh")
        initial = ",".join(f"{h.name}={h.etcd_peer}" for h in self.hosts)
        py = sys.executable
        for h in self.hosts:
            # each host's daemons talk to their own etcd member first (then the others)
            endpoints = ",".join(x.etcd_client for x in sorted(self.hosts,
                                                               key=lambda x: x is not h))
            common = ["--etcd-endpoints", endpoints, "--cluster-id", CLUSTER_ID,
                      "--etcd-lease-ttl", self.lease_ttl]
            lp = h.listen
            listen_client = f"http://{h.ip}:{lp['etcd']}"
            h.daemons["etcd"] = Daemon(h, "etcd", [
                etcd_bin, "--name", h.name, "--data-dir", os.path.join(self.data, h.name, "etcd"),
                "--listen-client-urls", listen_client, "--advertise-client-urls", h.etcd_client,
                "--listen-peer-urls", f"http://{h.ip}:{lp['etcd_peer']}",
                "--initial-advertise-peer-urls", h.etcd_peer,
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", CLUSTER_ID, "--heartbeat-interval", "100",
                "--election-timeout", "1000", "--max-txn-ops", "2048", "--log-level", "warn",
                # a member that comes back from a partition must not depose the leader
                # (etcd 3.4 leaves pre-vote off; 3.5 turns it on)
                "--pre-vote"],
                listen_client + "/health")
            if h in self.lookupd_hosts:
                h.daemons["nsqlookupd"] = Daemon(h, "nsqlookupd", [
                    py, "-m", "nsqlookupd.main",
                    "--tcp-address", f"{h.ip}:{lp['lookupd_tcp']}",
                    "--http-address", f"{h.ip}:{lp['lookupd_http']}",
                    "--broadcast-address", h.ip, *common,
                    *h.broadcast_ports(("lookupd_tcp", "tcp"), ("lookupd_http", "http"))],
                    f"http://{h.ip}:{lp['lookupd_http']}/ping")
            h.daemons["nsqd"] = Daemon(h, "nsqd", [
                *self.faketime_env(h), py, "-m", "nsqd.main", "--data-path", self.nsqd_data(h),
                "--tcp-address", f"{h.ip}:{lp['nsqd_tcp']}",
                "--http-address", f"{h.ip}:{lp['nsqd_http']}",
                "--rpc-address", f"{h.ip}:{lp['nsqd_rpc']}", "--broadcast-address", h.ip,
                *h.broadcast_ports(("nsqd_tcp", "tcp"), ("nsqd_http", "http"),
                                   ("nsqd_rpc", "rpc")),
                *common, *self.nsqd_flags], f"http://{h.ip}:{lp['nsqd_http']}/ping")
        etcds = [h.daemons["etcd"] for h in self.hosts]
        for d in etcds:  # all at once: a member waits for a quorum of its peers
            d.start()
        for d in etcds:
            d.wait_serving()
        for role in ("nsqlookupd", "nsqd"):
            group = [h.daemons[role] for h in self.hosts if role in h.daemons]
            for d in group:
                d.start()
            for d in group:
                d.wait_serving()
        self.wait(lambda: len(self.live_nodes()) == len(self.hosts), 30,
                  "every nsqd registered")

    def teardown(self) -> None:
        """Kill every daemon (SIGKILL: paused ones too, and quickly), then the network."""
        for h in self.hosts:
            for d in h.daemons.values():
                try:
                    d.kill()
                except OSError:
                    pass

    @staticmethod
    def wait(predicate, timeout: float, what: str, interval: float = 0.2):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise RuntimeError(f"not within {timeout:g} s: {what}")
            time.sleep(interval)

    # ---- views -----------------------------------------------------------------------

    @property
    def lookupd_http_addresses(self) -> list[str]:
        return [h.lookupd_http for h in self.lookupd_hosts]

    def lookupd_get(self, path: str):
        for h in self.lookupd_hosts:
            d = h.daemons.get("nsqlookupd")
            if d is None or not d.running or d.paused:
                continue
            try:
                status, body = http_json("GET", f"http://{h.lookupd_http}{path}", timeout=1)
            except OSError:
                continue
            if status == 200:
                return body
        return None

    def live_nodes(self) -> set[str]:
        body = self.lookupd_get("/nodes") or {}
        return {f"{p['broadcast_address']}:{p['tcp_port']}" for p in body.get("producers", [])}

    def master(self) -> Host | None:
        """The host of the master nsqlookupd, as /listlookup says."""
        leader = (self.lookupd_get("/listlookup") or {}).get("lookupdleader") or {}
        for h in self.lookupd_hosts:
            if leader.get("NodeIP") == h.ip and str(leader.get("HttpPort")) == str(
                    h.ports["lookupd_http"]):
                return h
        return None

    def leaders(self, topic: str) -> dict[int, Host]:
        """partition -> the host leading it, as /lookup says."""
        body = self.lookupd_get(f"/lookup?topic={topic}") or {}
        by_addr = {h.nsqd_tcp: h for h in self.hosts}
        out = {}
        for n, p in (body.get("partitions") or {}).items():
            h = by_addr.get(f"{p['broadcast_address']}:{p['tcp_port']}")
            if h is not None:
                out[int(n)] = h
        return out

    def ordered(self, topic: str) -> bool:
        body = self.lookupd_get(f"/lookup?topic={topic}") or {}
        return bool((body.get("meta") or {}).get("ordered", False))

    def create_topic(self, topic: str, partitions: int, replicas: int,
                     ordered: bool = False, sync_every: int = 1) -> None:
        def created():
            m = self.master()
            if m is None:
                return False
            status, body = http_json(
                "POST", f"http://{m.lookupd_http}/topic/create?topic={topic}"
                        f"&partition_num={partitions}&replicator={replicas}"
                        f"&orderedmulti={str(ordered).lower()}&syncdisk={sync_every}",
                timeout=5)
            if status != 200:
                raise RuntimeError(f"/topic/create answered {status}: {body}")
            return True
        self.wait(created, 20, "a master nsqlookupd created the topic")
        self.wait(lambda: len(self.leaders(topic)) == partitions, 30,
                  f"every partition of {topic} led")

    def nsqd_http(self, host: Host) -> str:
        return f"{host.ip}:{host.ports['nsqd_http']}"

    def nsqd_stats(self, host: Host, timeout: float = 2) -> dict | None:
        """The host's nsqd /stats (JSON), or None (down, paused, no answer)."""
        d = host.daemons.get("nsqd")
        if d is None or not d.running or d.paused:
            return None
        try:
            status, body = http_json("GET", f"http://{self.nsqd_http(host)}/stats?format=json",
                                     timeout=timeout)
        except OSError:
            return None
        return body if status == 200 and isinstance(body, dict) else None

    def partition_states(self, topic: str) -> dict[int, dict]:
        """partition -> {leader, epoch, isr (host names), writable, committed_offset}, as
        each partition's leader says in its /stats (a partition no live nsqd leads is
        missing; two nodes that both say they lead: the higher epoch)."""
        by_id = {h.nsqd_tcp: h.name for h in self.hosts}
        out: dict[int, dict] = {}
        for h in self.hosts:
            stats = self.nsqd_stats(h)
            if not stats:
                continue
            leading = ((stats.get("cluster") or {}).get("replication") or {}).get("leading") or {}
            committed = {}
            for t in stats.get("topics") or ():
                if t.get("topic_name") == topic:
                    for p in t.get("partitions") or ():
                        committed[p.get("partition")] = p.get("committed_offset")
            for key, st in leading.items():
                name, _, n = key.rpartition("/")
                if name != topic:
                    continue
                n = int(n)
                if n in out and out[n]["epoch"] >= st.get("epoch", 0):
                    continue
                out[n] = {"leader": h.name, "epoch": st.get("epoch", 0),
                          "isr": [by_id.get(i, i) for i in st.get("isr") or ()],
                          "writable": st.get("writable"),
                          "committed_offset": committed.get(n)}
        return out

    # ---- clocks (libfaketime under every nsqd when clock_skew) ---------------------------

    def clock_file(self, host: Host) -> str:
        return os.path.join(self.data, host.name, "faketime")

    def faketime_env(self, host: Host) -> list[str]:
        """`env LD_PRELOAD=libfaketime ...` before nsqd's argv (clock_skew only): its wall
        clock is the real one plus the offset in `clock_file(host)`, reread at most a
        second after it changes. The monotonic clocks stay real (asyncio's timers, the
        leases' timing), as an NTP step leaves them; etcd and nsqlookupd are never under
        it. FAKETIME_FORCE_MONOTONIC_FIX=0: libfaketime 0.9.10's fix of
        pthread_cond_timedwait made every hand-over between nsqd's event loop and its
        write workers take milliseconds (measured: 2-10 ms a hop instead of 30-60 us, a
        publish p50 of 400 ms), and it is only needed when the monotonic clock is faked.
        Under DONT_FAKE_MONOTONIC, libfaketime 0.9.10 fails Python's time.sleep with EINVAL
        (clock_nanosleep); nsqd never calls it (asyncio and threading waits work)."""
        if not self.clock_skew:
            return []
        return ["env", f"LD_PRELOAD={self._faketime_lib}",
                f"FAKETIME_TIMESTAMP_FILE={self.clock_file(host)}",
                "FAKETIME_CACHE_DURATION=1", "FAKETIME_DONT_FAKE_MONOTONIC=1",
                "FAKETIME_FORCE_MONOTONIC_FIX=0"]

    def set_clock(self, host: Host, offset_s: float) -> None:
        """The host's nsqd clock becomes real + offset_s (within about 2 s: libfaketime's
        cache). Written whole (rename), so it never reads a half-written file."""
        path = self.clock_file(host)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write(f"{offset_s:+.3f}\n")
        os.replace(path + ".tmp", path)

    # ---- faults (the network: both kinds; disks and power: NetnsCluster) ----------------

    def drop(self, host: Host, sources: list[Host]) -> None:
        raise RuntimeError("this cluster cannot partition")

    def heal_network(self) -> int | None:
        """Undo every drop; the loopback cluster returns how many connections it held."""
        return None

    def fill_disk(self, host: Host) -> None:
        raise RuntimeError("this cluster has no disks to fill (loopback fallback)")

    def free_disk(self, host: Host) -> None:
        pass

    def power_cut(self, host: Host) -> None:
        raise RuntimeError("this cluster has no PowerFS disks (loopback fallback)")

    def power_cut_many(self, hosts: list[Host]) -> None:
        raise RuntimeError("this cluster has no PowerFS disks (loopback fallback)")

    def nsqd_data(self, host: Host) -> str:
        return os.path.join(self.data, host.name, "nsqd")


class LoopbackCluster(Cluster):
    """No root: every host on 127.0.0.1 with ports of its own. Every port a host is known
    by is a relay of jepsen/proxy.py owned by that host, forwarding to the port its daemon
    listens on (`Host.listen`); partitions stall the relayed connections between hosts."""

    can_partition = True
    ROLES = ("etcd", "etcd_peer", "nsqd_tcp", "nsqd_http", "nsqd_rpc", "lookupd_tcp",
             "lookupd_http")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for h in self.hosts:
            h.listen = {k: free_port() for k in self.ROLES}
        self.relays: Relays | None = None

    def ip_of(self, index: int) -> str:
        return "127.0.0.1"

    def ports_of(self, index: int) -> dict[str, int]:
        return {k: free_port() for k in self.ROLES}

    def setup(self) -> None:
        self.relays = Relays(self._daemon_pids)
        for h in self.hosts:
            for k in self.ROLES:
                if k.startswith("lookupd") and h not in self.lookupd_hosts:
                    continue
                self.relays.add(h.name, h.ports[k], h.listen[k])
        super().setup()

    def _daemon_pids(self) -> dict[int, str]:
        return {d.proc.pid: h.name for h in self.hosts for d in list(h.daemons.values())
                if d.proc is not None}

    def teardown(self) -> None:
        super().teardown()
        if self.relays is not None:
            self.relays.close()

    def drop(self, host: Host, sources: list[Host]) -> None:
        """What `host` would drop with iptables: its connections with `sources` stall."""
        self.relays.drop(host.name, [s.name for s in sources])

    def heal_network(self) -> int | None:
        return self.relays.heal() if self.relays is not None else None


class NetnsCluster(Cluster):
    host_class = NetnsHost
    harness_ip = HARNESS_IP
    can_partition = True
    FILLERS = ("jepsen-fill", "jepsen-fill-small")
    PORTS = {"etcd": 2379, "etcd_peer": 2380, "nsqd_tcp": 4150, "nsqd_http": 4151,
             "nsqd_rpc": 4250, "lookupd_tcp": 4160, "lookupd_http": 4161}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.disks = {}  # host name -> its PowerFS (powerfs=True)

    @property
    def can_fill_disk(self) -> bool:
        return not self.powerfs

    @property
    def can_power_cut(self) -> bool:
        return self.powerfs

    def ip_of(self, index: int) -> str:
        return f"{SUBNET}.{index}"

    def ports_of(self, index: int) -> dict[str, int]:
        return dict(self.PORTS)

    def setup(self) -> None:
        cleanup_leftovers()
        if shutil.which("iptables") is None:
            raise RuntimeError("iptables is not installed: run scripts/setup.sh")
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{HARNESS_IP}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        for h in self.hosts:
            outside = f"{PREFIX}v{h.index}"
            sh("ip", "netns", "add", h.netns)
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0",
               "netns", h.netns)
            sh("ip", "link", "set", outside, "master", BRIDGE)
            sh("ip", "link", "set", outside, "up")
            for cmd in (["ip", "addr", "add", f"{h.ip}/24", "dev", "eth0"],
                        ["ip", "link", "set", "eth0", "up"], ["ip", "link", "set", "lo", "up"]):
                sh("ip", "netns", "exec", h.netns, *cmd)
            disk = self.nsqd_data(h)
            os.makedirs(disk, exist_ok=True)
            if self.powerfs:
                self._mount_powerfs(h)
            else:
                sh("mount", "-t", "tmpfs", "-o", f"size={self.disk_mb}m", h.netns, disk)
        super().setup()

    def _mount_powerfs(self, host: Host) -> None:
        """The host's nsqd data path becomes a PowerFS over `<data path>.disk` (what survives
        a cut, and everything after a clean unmount). Its process carries MARK, so the
        cleanup of a killed harness finds it; the mount's source is `jep-nI`."""
        from tests.powerfs import PowerFS  # a test tool: the harness runs from a checkout

        disk = self.nsqd_data(host)
        fs = PowerFS(disk + ".disk", disk, fsname=host.netns, env={MARK: self.store})
        os.makedirs(self.logs, exist_ok=True)
        fs.log_path = os.path.join(self.logs, f"{host.name}-powerfs.log")
        self.disks[host.name] = fs
        fs.mount()

    def teardown(self) -> None:
        super().teardown()
        for fs in self.disks.values():  # every nsqd is dead: a clean unmount keeps it all
            fs.unmount()
        cleanup_leftovers()

    def power_cut(self, host: Host) -> None:
        """SIGKILL the host's nsqd, drop what its PowerFS holds unsynced, unmount it and
        mount it again on what survived (the caller starts the nsqd again)."""
        self.power_cut_many([host])

    def power_cut_many(self, hosts: list[Host]) -> None:
        """Cut several hosts' power at once: every nsqd SIGKILLed first (from then on
        nothing of theirs changes), then each PowerFS cut and mounted again in turn (what
        it drops was decided at the kill, so the cuts are as one)."""
        for h in hosts:
            h.daemons["nsqd"].kill()
        for h in hosts:
            self.disks[h.name].cut()

    def fill_disk(self, host: Host) -> None:
        """Take every free block of the host's nsqd disk (a real ENOSPC for nsqd)."""
        disk = self.nsqd_data(host)
        for name, chunk in zip(self.FILLERS, (1 << 16, 512)):
            with open(os.path.join(disk, name), "ab", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * chunk)
                except OSError:
                    pass

    def free_disk(self, host: Host) -> None:
        for name in self.FILLERS:
            try:
                os.unlink(os.path.join(self.nsqd_data(host), name))
            except FileNotFoundError:
                pass

    def drop(self, host: Host, sources: list[Host]) -> None:
        """`host` drops every packet from `sources` (one way; call both ways to cut)."""
        for s in sources:
            sh("ip", "netns", "exec", host.netns, "iptables", "-w", "-A", "INPUT",
               "-s", s.ip, "-j", "DROP")

    def heal_network(self) -> None:
        for h in self.hosts:
            sh("ip", "netns", "exec", h.netns, "iptables", "-w", "-F", "INPUT", check=False)


def cleanup_leftovers() -> list[str]:
    """Remove whatever an earlier run left (its processes, namespaces, links); return
    what was removed. Safe to call any time: it touches only `jep-` names."""
    removed = [f"process {pid}" for pid in _kill_stray_processes()]
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return removed
    mounts = []
    with open("/proc/mounts") as f:
        for line in f:
            source, target = line.split()[:2]
            if source.startswith(PREFIX):
                mounts.append(target.encode().decode("unicode_escape"))
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5  # the processes must die before the namespace goes
        while sh("ip", "netns", "pids", name, check=False).stdout.strip():
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        sh("ip", "netns", "del", name, check=False)
        removed.append(f"netns {name}")
    for target in mounts:  # after the processes that used them are gone
        sh("umount", "-l", target, check=False)
        removed.append(f"mount {target}")
    for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(PREFIX):
                sh("ip", "link", "del", name, check=False)
                removed.append(f"link {name}")
    return removed


def _kill_stray_processes() -> list[int]:
    """SIGKILL every other jepsen harness, then every daemon a harness started (MARK in its
    environment), wherever it runs; return their pids. Our own process and its ancestors
    are spared: a harness started by a test has the test runner above it."""
    spared, pid = set(), os.getpid()
    while pid > 1:
        spared.add(pid)
        pid = _parent_of(pid)
    harnesses, daemons = [], []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in spared:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{name}/environ", "rb") as f:
                marked = any(v.startswith(MARK.encode() + b"=") for v in f.read().split(b"\0"))
        except OSError:  # gone, or not ours to read
            continue
        if b"-m" in args and args[args.index(b"-m") + 1:][:1] == [b"jepsen"]:
            harnesses.append(int(name))
        elif marked:
            daemons.append(int(name))
    for pids in (harnesses, daemons):
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    return harnesses + daemons


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def faketime_library() -> str:
    """Debian's libfaketime (package libfaketime, pulled by faketime; scripts/setup.sh), the
    multi-threaded build (nsqd has worker threads)."""
    import glob

    for pattern in ("/usr/lib/*/faketime/libfaketimeMT.so.1", "/usr/lib/faketime/libfaketimeMT.so.1",
                    "/usr/lib/*/faketime/libfaketime.so.1"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    raise RuntimeError("libfaketime is not installed (the clock-skew nemesis): run "
                       "scripts/setup.sh, or apt-get install faketime")


def make_cluster(store: str, nodes: int, lookupds: int, nsqd_flags=(), loopback: bool = False,
                 disk_mb: int = 64, powerfs: bool = False, clock_skew: bool = False) -> Cluster:
    """A NetnsCluster when we are root with `ip` and iptables, else the loopback one (which
    has no PowerFS: `powerfs` is for the network namespaces only)."""
    if not loopback and os.geteuid() == 0 and shutil.which("ip") and shutil.which("iptables"):
        return NetnsCluster(store, nodes, lookupds, tuple(nsqd_flags), disk_mb=disk_mb,
                            powerfs=powerfs, clock_skew=clock_skew)
    return LoopbackCluster(store, nodes, lookupds, tuple(nsqd_flags), disk_mb=disk_mb,
                           clock_skew=clock_skew)
