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
- restart: SIGKILL every nsqd at once; heal: start them all.
- disk-full (network namespaces only): fill the nsqd disk (its own tmpfs) of a random
  host or of a partition's leader; heal: delete the filler.
- power-cut (network namespaces only; every nsqd's data on PowerFS instead of a tmpfs, so
  not with disk-full): SIGKILL the nsqd of a random host or of a partition's leader, cut
  the power of its file system (what was not synced is gone), unmount, mount again on
  what survived, start the nsqd; heal: it must be serving (a node that cannot start on
  what a power cut left ends the run).

`final_heal()` undoes everything: network healed, disks freed, paused processes
continued, every dead daemon started again.
"""

from __future__ import annotations

import random
import signal
import time

from jepsen.cluster import Cluster, Host

KINDS = ("kill", "pause", "partition", "restart", "disk-full", "power-cut")


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
        self.cluster, self.topic, self.kinds, self.rng = cluster, topic, kinds, rng
        self.turn = 0
        self.current: dict | None = None

    # ---- choosing -------------------------------------------------------------------

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
        affected = self._affected(self.cluster.hosts)
        for h in self.cluster.hosts:
            h.daemons["nsqd"].kill()
        return {"mode": "every nsqd", "hosts": [h.name for h in self.cluster.hosts],
                "partitions": affected}

    def _stop_restart(self, fault: dict) -> dict:
        self._start_nsqd(self.cluster.hosts)
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
        host, why = self._target()
        affected = self._affected([host])
        began = time.monotonic()
        self.cluster.power_cut(host)
        host.daemons["nsqd"].start()  # its serving is the heal's to check
        return {"mode": why, "hosts": [host.name], "partitions": affected,
                "cut_s": round(time.monotonic() - began, 2)}

    def _stop_power_cut(self, fault: dict) -> dict:
        for h in self._hosts(fault["hosts"]):
            h.daemons["nsqd"].wait_serving()
        return {"kind": "power-cut", "serving": fault["hosts"]}

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

    @staticmethod
    def _start_nsqd(hosts: list[Host]) -> None:
        for h in hosts:
            if not h.daemons["nsqd"].running:
                h.daemons["nsqd"].start()
        for h in hosts:
            h.daemons["nsqd"].wait_serving()
