"""Nemeses: faults on the cluster's nsqds and network, each a `start()` (the fault) and a
`stop()` (its heal), both blocking (the runner calls them from a thread), both recorded
in the History as `info` operations of process `nemesis`.

- kill: SIGKILL the nsqd of a random host or of a partition's leader; heal: start it
  again on the same data.
- pause: SIGSTOP the nsqd of a random host or of a partition's leader; heal: SIGCONT.
- partition: random halves, isolate a partition's leader,
  isolate the master nsqlookupd's host, a bridge (two halves that share one host, which
  sees both), or one-way (a random half drops what the other sends); iptables DROP rules
  inside the hosts (or stalled relays on loopback, jepsen/proxy.py), so etcd, nsqlookupd
  and nsqd traffic between hosts is cut while the harness still reaches every host;
  heal: flush the rules.
- restart: SIGKILL and start again at once, within the lease TTL (2 s): a partition's
  leader, a random host, or every nsqd (modes chosen per fault from the seed); or, the
  fourth mode, every nsqd SIGKILLed and left down until the heal (the behaviour of
  `restart` before the immediate modes, longer than the TTL); heal: every one serving.
- disk-full (network namespaces only): fill the nsqd disk (its own tmpfs) of a random
  host or of a partition's leader; heal: delete the filler.
- power-cut (network namespaces only; every nsqd's data on PowerFS instead of a tmpfs, so
  not with disk-full): SIGKILL the nsqd of a random host or of a partition's leader, cut
  the power of its file system (what was not synced is gone), unmount, mount again on
  what survived, start the nsqd; heal: it must be serving (a node that cannot start on
  what a power cut left ends the run). Modes: one host (a random one or a partition's
  leader), two of a partition's in-sync replicas, or all of its replicas (with R=3 on 3
  hosts: the whole cluster), cut at once.
- etcd-pause: SIGSTOP one etcd member or all of them for 1-10 s, then SIGCONT (a timer);
  a third mode pauses all and SIGKILLs a follower of a partition during the pause (its
  leader's ISR shrink must go through a stalled etcd); heal: the pause is over, the
  follower started again.
- clock-skew (every nsqd under libfaketime, etcd and nsqlookupd never): one host's nsqd
  clock, or every host's (each its own offset), off by up to 2 s either way, at runtime;
  the fault measures the offset from the nsqd's own /stats; heal: every clock real again.

`final_heal()` undoes everything: network healed, disks freed, paused processes
continued, every dead daemon started again.
"""

from __future__ import annotations

import random
import re
import signal
import threading
import time
import urllib.request

from jepsen.cluster import Cluster, Host

KINDS = ("kill", "pause", "partition", "restart", "disk-full", "power-cut", "etcd-pause",
         "clock-skew")
LEASE_TTL_S = 2.0  # the cluster's --etcd-lease-ttl (jepsen/cluster.py)
MAX_SKEW_S = 2.0
ETCD_PAUSE_S = (1.0, 10.0)


class Nemesis:
    def __init__(self, cluster: Cluster, topic: str, kinds: list[str], rng: random.Random):
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown nemesis {sorted(unknown)}: choose from {KINDS}")
        if "partition" in kinds and not cluster.can_partition:
            raise ValueError("this cluster cannot partition")
        if "disk-full" in kinds and "power-cut" in kinds:
            raise ValueError("disk-full and power-cut cannot run together: with power-cut "
                             "every nsqd's data is on PowerFS (in memory, never full), not "
                             "on a tmpfs")
        if "power-cut" in kinds and not cluster.can_power_cut:
            raise ValueError("the power-cut nemesis needs root (a FUSE mount per host); "
                             "this is the loopback fallback")
        if "disk-full" in kinds and not cluster.can_fill_disk:
            raise ValueError("the disk-full nemesis needs root (a tmpfs per host); this is "
                             "the loopback fallback")
        if "clock-skew" in kinds and not cluster.clock_skew:
            raise ValueError("the clock-skew nemesis needs a cluster started with clock_skew "
                             "(every nsqd under libfaketime)")
        self.cluster, self.topic, self.kinds, self.rng = cluster, topic, kinds, rng
        self.turn = 0
        self.current: dict | None = None
        self._timer: threading.Timer | None = None  # etcd-pause's SIGCONT
        self._bags: dict[str, list[str]] = {}

    # ---- choosing -------------------------------------------------------------------

    def _mode(self, kind: str, modes: list[str]) -> str:
        """The next mode of a kind: each run of len(modes) faults of that kind takes every
        mode once, in an order the seed shuffles (so a short run sees them all)."""
        bag = self._bags.get(kind)
        if not bag:
            bag = self._bags[kind] = list(modes)
            self.rng.shuffle(bag)
        return bag.pop()

    def _target(self) -> tuple[Host, str]:
        """A random host, or the leader of a random partition (every other time)."""
        leaders = self.cluster.leaders(self.topic)
        if leaders and self.rng.random() < 0.5:
            n = self.rng.choice(sorted(leaders))
            return leaders[n], f"leader of partition {n}"
        return self.rng.choice(self.cluster.hosts), "random host"

    def _affected(self, hosts: list[Host]) -> list[int]:
        """The partitions led by `hosts` now: those whose leader the fault takes away."""
        names = {h.name for h in hosts}
        return sorted(n for n, h in self.cluster.leaders(self.topic).items() if h.name in names)

    # ---- faults ----------------------------------------------------------------------

    def start(self) -> dict:
        """The next fault (the kinds in turn); returns what it did."""
        kind = self.kinds[self.turn % len(self.kinds)]
        self.turn += 1
        self.current = getattr(self, f"_start_{kind.replace('-', '_')}")()
        self.current["kind"] = kind
        return self.current

    def stop(self) -> dict:
        fault, self.current = self.current, None
        if fault is None:
            return {}
        return getattr(self, f"_stop_{fault['kind'].replace('-', '_')}")(fault)

    def _start_kill(self) -> dict:
        host, why = self._target()
        affected = self._affected([host])
        host.daemons["nsqd"].kill()
        return {"mode": why, "hosts": [host.name], "partitions": affected}

    def _stop_kill(self, fault: dict) -> dict:
        for h in self._hosts(fault["hosts"]):
            self._start_nsqd([h])
        return {"kind": "kill", "restarted": fault["hosts"]}

    def _start_pause(self) -> dict:
        host, why = self._target()
        affected = self._affected([host])
        host.daemons["nsqd"].signal(signal.SIGSTOP)
        return {"mode": why, "hosts": [host.name], "partitions": affected}

    def _stop_pause(self, fault: dict) -> dict:
        for h in self._hosts(fault["hosts"]):
            h.daemons["nsqd"].signal(signal.SIGCONT)
        return {"kind": "pause", "continued": fault["hosts"]}

    def _start_restart(self) -> dict:
        mode = self._mode("restart", ["leader-now", "host-now", "every-now", "every-down"])
        if mode == "leader-now" or mode == "host-now":
            leaders = self.cluster.leaders(self.topic)
            if mode == "leader-now" and leaders:
                n = self.rng.choice(sorted(leaders))
                hosts, why = [leaders[n]], f"leader of partition {n}"
            else:
                hosts, why = [self.rng.choice(self.cluster.hosts)], "random host"
        else:
            hosts, why = list(self.cluster.hosts), "every nsqd"
        affected = self._affected(hosts)
        began = time.monotonic()
        for h in hosts:
            h.daemons["nsqd"].kill()
        out = {"mode": mode, "target": why, "hosts": [h.name for h in hosts],
               "partitions": affected}
        if mode == "every-down":
            return out  # started at the heal, `--interval` later
        for h in hosts:  # at once: the killed node's lease (2 s) is still in etcd
            h.daemons["nsqd"].start()
        started = time.monotonic() - began
        for h in hosts:
            h.daemons["nsqd"].wait_serving()
        serving = time.monotonic() - began
        return dict(out, started_s=round(started, 3), serving_s=round(serving, 2),
                    within_ttl=started < LEASE_TTL_S)

    def _stop_restart(self, fault: dict) -> dict:
        self._start_nsqd(self._hosts(fault["hosts"]))
        return {"kind": "restart", "restarted": fault["hosts"]}

    def _start_disk_full(self) -> dict:
        host, why = self._target()
        affected = self._affected([host])
        self.cluster.fill_disk(host)
        return {"mode": why, "hosts": [host.name], "partitions": affected}

    def _stop_disk_full(self, fault: dict) -> dict:
        for h in self._hosts(fault["hosts"]):
            self.cluster.free_disk(h)
        return {"kind": "disk-full", "freed": fault["hosts"]}

    def _start_power_cut(self) -> dict:
        mode = self._mode("power-cut", ["one", "two", "all"])
        if mode == "one":
            host, why = self._target()
            hosts = [host]
        else:
            hosts, why = self._replicas_of_a_partition(2 if mode == "two" else None)
        affected = self._affected(hosts)
        began = time.monotonic()
        self.cluster.power_cut_many(hosts)
        for h in hosts:
            h.daemons["nsqd"].start()  # its serving is the heal's to check
        return {"mode": mode, "target": why, "hosts": [h.name for h in hosts],
                "partitions": affected, "cut_s": round(time.monotonic() - began, 2)}

    def _replicas_of_a_partition(self, count: int | None) -> tuple[list[Host], str]:
        """`count` (None: all) of a random partition's in-sync replicas, its leader first; a
        partition with fewer (R=1, or a shrunk ISR) is topped up with random hosts."""
        states = self.cluster.partition_states(self.topic)
        want = count or max([len(s["isr"]) for s in states.values()] + [1])
        names: list[str] = []
        why = "random hosts"
        if states:
            n = self.rng.choice(sorted(states))
            st = states[n]
            names = [st["leader"]] + [i for i in st["isr"] if i != st["leader"]]
            why = f"replicas of partition {n}"
        names = names[:want]
        others = [h.name for h in self.cluster.hosts if h.name not in names]
        self.rng.shuffle(others)
        names += others[:want - len(names)]
        return self._hosts_in_order(names), why

    def _stop_power_cut(self, fault: dict) -> dict:
        for h in self._hosts(fault["hosts"]):
            h.daemons["nsqd"].wait_serving()
        return {"kind": "power-cut", "serving": fault["hosts"]}

    def _start_etcd_pause(self) -> dict:
        mode = self._mode("etcd-pause", ["one-member", "all-members",
                                          "all-members+follower-kill"])
        duration = round(self.rng.uniform(*ETCD_PAUSE_S), 1)
        members = ([self.rng.choice(self.cluster.hosts)] if mode == "one-member"
                   else list(self.cluster.hosts))
        victim, why, affected = None, None, []
        if mode.endswith("follower-kill"):
            states = self.cluster.partition_states(self.topic)  # before etcd stalls
            choices = [(n, i) for n, st in sorted(states.items()) for i in st["isr"]
                       if i != st["leader"]]
            if choices:
                n, name = self.rng.choice(choices)
                victim, why = self._hosts([name])[0], f"follower of partition {n}"
            else:
                victim, why = self.rng.choice(self.cluster.hosts), "random host"
            affected = self._affected([victim])
        began = time.monotonic()
        for h in members:
            h.daemons["etcd"].signal(signal.SIGSTOP)
        self._timer = threading.Timer(duration, self._continue_etcd, args=(members,))
        self._timer.daemon = True
        self._timer.start()
        out = {"mode": mode, "etcd": [h.name for h in members], "pause_s": duration,
               "hosts": [], "partitions": affected}
        if victim is not None:
            time.sleep(min(0.3, duration / 4))  # etcd is stalled before the follower fails
            victim.daemons["nsqd"].kill()
            out.update(hosts=[victim.name], target=why,
                       killed_after_s=round(time.monotonic() - began, 2))
        return out

    def _continue_etcd(self, members: list[Host]) -> None:
        for h in members:
            h.daemons["etcd"].signal(signal.SIGCONT)

    def _stop_etcd_pause(self, fault: dict) -> dict:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.join()  # a pause longer than the interval is served in full
        self._continue_etcd(self._hosts(fault["etcd"]))
        self._start_nsqd(self._hosts(fault["hosts"]))
        return {"kind": "etcd-pause", "continued": fault["etcd"], "restarted": fault["hosts"]}

    def _start_clock_skew(self) -> dict:
        mode = self._mode("clock-skew", ["one-host", "every-host"])
        if mode == "one-host":
            host, why = self._target()
            hosts = [host]
        else:
            hosts, why = list(self.cluster.hosts), "every host"
        offsets = {}
        for h in hosts:
            magnitude = round(self.rng.uniform(0.3, MAX_SKEW_S), 3)
            offsets[h.name] = magnitude if self.rng.random() < 0.5 else -magnitude
        before = {h.name: self._uptime(h) for h in hosts}
        for h in hosts:
            self.cluster.set_clock(h, offsets[h.name])
        time.sleep(2.5)  # libfaketime rereads its file at most a second after a change
        measured = {}
        for h in hosts:
            after = self._uptime(h)
            if before[h.name] and after:
                # the nsqd's uptime (its wall clock minus its start time) grew by the real
                # time elapsed plus the change of its offset
                measured[h.name] = round((after[1] - before[h.name][1])
                                         - (after[0] - before[h.name][0]), 3)
        return {"mode": mode, "target": why, "hosts": [h.name for h in hosts],
                "partitions": self._affected(hosts), "offsets_s": offsets,
                "measured_s": measured,
                "faketime": {role: any(self._preloaded(h.daemons[role]) for h in hosts)
                             for role in ("nsqd", "etcd")}}

    @staticmethod
    def _preloaded(d) -> bool:
        """Whether the daemon's process runs with libfaketime preloaded."""
        if not d.running:
            return False
        try:
            with open(f"/proc/{d.proc.pid}/environ", "rb") as f:
                return b"libfaketime" in f.read()
        except OSError:
            return False

    def _uptime(self, host: Host) -> tuple[float, float] | None:
        """(the harness's monotonic time, the nsqd's uptime in s from its text /stats)."""
        d = host.daemons["nsqd"]
        if not d.running or d.paused:
            return None
        url = f"http://{self.cluster.nsqd_http(host)}/stats?include_clients=false"
        try:
            t0 = time.monotonic()
            with urllib.request.urlopen(url, timeout=2) as r:
                text = r.read().decode(errors="replace")
            t1 = time.monotonic()
        except OSError:
            return None
        m = re.search(r"^uptime (\S+)$", text, re.M)
        return ((t0 + t1) / 2, go_seconds(m.group(1))) if m else None

    def _stop_clock_skew(self, fault: dict) -> dict:
        for h in self._hosts(fault["hosts"]):
            self.cluster.set_clock(h, 0.0)
        return {"kind": "clock-skew", "reset": fault["hosts"]}

    def _start_partition(self) -> dict:
        hosts = list(self.cluster.hosts)
        self.rng.shuffle(hosts)
        mode = self.rng.choice(["halves", "isolate-leader", "isolate-master", "bridge",
                                "one-way"])
        if mode == "isolate-leader":
            leaders = self.cluster.leaders(self.topic)
            target = leaders[self.rng.choice(sorted(leaders))] if leaders else hosts[0]
            a, b = [target], [h for h in hosts if h is not target]
        elif mode == "isolate-master":
            master = self.cluster.master() or hosts[0]
            a, b = [master], [h for h in hosts if h is not master]
        else:
            half = len(hosts) // 2
            a, b = hosts[:half], hosts[half:]
        if mode == "bridge" and len(hosts) >= 3:
            # the bridge host (first of b) sees both sides; the rest of b and a are cut
            bridge, rest = b[0], b[1:]
            self._cut(a, rest)
            desc = {"grudge": [[h.name for h in a], [bridge.name], [h.name for h in rest]]}
        elif mode == "one-way":
            for h in b:
                self.cluster.drop(h, a)  # b drops what a sends; a still hears b
            desc = {"dropped_by": [h.name for h in b], "from": [h.name for h in a]}
        else:
            self._cut(a, b)
            desc = {"sides": [[h.name for h in a], [h.name for h in b]]}
        minority = a if len(a) <= len(b) else b
        return {"mode": mode, **desc, "hosts": [h.name for h in minority],
                "partitions": self._affected(minority)}

    def _cut(self, a: list[Host], b: list[Host]) -> None:
        for h in a:
            self.cluster.drop(h, b)
        for h in b:
            self.cluster.drop(h, a)

    def _stop_partition(self, fault: dict) -> dict:
        held = self.cluster.heal_network()  # the loopback relays count what they held
        return {"kind": "partition", "healed": True,
                **({} if held is None else {"held_connections": held})}

    # ---- heal everything ------------------------------------------------------------

    def final_heal(self) -> dict:
        """Network healed, disks freed, paused nsqds continued, dead daemons started."""
        self.current = None
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()  # its members are continued below with every paused daemon
        if self.cluster.clock_skew:
            for h in self.cluster.hosts:
                self.cluster.set_clock(h, 0.0)
        self.cluster.heal_network()
        for h in self.cluster.hosts:
            self.cluster.free_disk(h)
        dead = []
        for h in self.cluster.hosts:
            for d in h.daemons.values():
                if d.paused:
                    d.signal(signal.SIGCONT)
        for role in ("etcd", "nsqlookupd", "nsqd"):
            group = [h.daemons[role] for h in self.cluster.hosts
                     if role in h.daemons and not h.daemons[role].running]
            for d in group:
                d.start()
                dead.append(f"{d.host.name} {role}")
            for d in group:
                d.wait_serving()
        return {"kind": "final-heal", "restarted": dead}

    def _hosts(self, names: list[str]) -> list[Host]:
        return [h for h in self.cluster.hosts if h.name in names]

    def _hosts_in_order(self, names: list[str]) -> list[Host]:
        by_name = {h.name: h for h in self.cluster.hosts}
        return [by_name[n] for n in names if n in by_name]

    @staticmethod
    def _start_nsqd(hosts: list[Host]) -> None:
        for h in hosts:
            if not h.daemons["nsqd"].running:
                h.daemons["nsqd"].start()
        for h in hosts:
            h.daemons["nsqd"].wait_serving()


def go_seconds(text: str) -> float:
    """A Go duration as nsqd's /stats prints it ("1h2m3.5s", "250ms", "0s") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    total = 0.0
    for number, unit in re.findall(r"([0-9.]+)(h|ms|us|µs|ns|m|s)", text):
        total += float(number) * units[unit]
    return total
