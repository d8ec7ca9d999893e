"""jepsen/: the checkers on small written histories, and real runs of the harness
(network namespaces as root, else the loopback fallback): a 60-second run with kill and
pause against R=1 topics must pass; the deliberately broken build
(`--test-ack-before-sync`) must be caught by the total-queue checker under the
disk-full nemesis; the power-cut nemesis (nsqd on PowerFS) loses nothing acknowledged, and
catches acknowledgements of unsynced data that kill -9 cannot; Ctrl-C leaves nothing
behind, nor does `--cleanup` after a killed harness (PowerFS mounts included); a loopback
run with the partition nemesis loses nothing. The hour-long run is behind --long.

Every run of the harness is in this module: test.sh's xdist workers take a module whole
(`--dist loadfile`), so these runs never overlap (each clears the machine's `jep-` names,
mounts and harness processes before it starts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jepsen import checker, replicas
from jepsen.cluster import PREFIX, cleanup_leftovers
from jepsen.nemesis import go_seconds

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def op(type_, f, t, process, value=None):
    return {"type": type_, "f": f, "time": t, "process": process, "value": value,
            "node": None}


def enq(t, process, vid, outcome, key=None, seq=0, partition=None, latency=0.01):
    v = {"id": vid, "key": key, "seq": seq, "partition": partition}
    out = [op("invoke", "enqueue", t, process, v)]
    if outcome:
        out.append(op(outcome, "enqueue", t + latency, process, v))
    return out


def deq(t, vid, key=None, seq=0):
    return op("ok", "dequeue", t, "c1", {"id": vid, "key": key, "seq": seq})


# ---- checkers on written histories --------------------------------------------------


def test_total_queue_counts_lost_unexpected_duplicates_and_recovered():
    h = (enq(0, "p1", "a", "ok") + enq(1, "p1", "b", "ok") + enq(2, "p1", "c", "info")
         + enq(3, "p1", "d", "fail") + enq(4, "p1", "e", None)
         + [deq(5, "a"), deq(6, "a"), deq(7, "c"), deq(8, "zz"), deq(9, "d")])
    r = checker.total_queue(h)
    assert r["valid"] is False
    assert (r["attempted"], r["acknowledged"], r["indeterminate"], r["failed"]) == (5, 2, 2, 1)
    assert (r["lost"], r["lost_ids"]) == (1, ["b"])
    assert sorted(r["unexpected_ids"]) == ["d", "zz"]  # never attempted; failed yet seen
    assert (r["duplicated"], r["duplicate_deliveries"], r["recovered"]) == (1, 1, 1)


def test_total_queue_valid_when_every_acknowledged_is_dequeued():
    h = enq(0, "p1", "a", "ok") + enq(0, "p2", "b", "info") + [deq(1, "a")]
    r = checker.total_queue(h)
    assert r["valid"] is True and r["lost"] == 0 and r["unexpected"] == 0


def test_a_value_stored_twice_fails_only_an_idempotent_producers_run():
    def named(vid):
        out = enq(0, "p1", vid, "ok")
        for o in out:
            o["value"] = dict(o["value"], named=True)
        return out

    def copy(t, vid, msg_id):
        return op("ok", "dequeue", t, "c1", {"id": vid, "key": None, "seq": 0, "msg_id": msg_id})

    h = (named("a") + enq(0, "p9", "b", "ok")
         + [copy(1, "a", "01"), copy(2, "a", "01"),  # a redelivery: one stored copy
            copy(3, "b", "02"), copy(4, "b", "03")])  # a classic retry, stored twice
    r = checker.total_queue(h)
    assert r["valid"] is True and (r["stored_twice"], r["named_stored_twice"]) == (1, 0)
    r = checker.total_queue(h + [copy(5, "a", "04")])  # the idempotent one, stored twice
    assert r["valid"] is False and r["named_stored_twice_ids"] == ["a"]


def test_a_poison_message_among_the_dead_letters_is_not_lost():
    def op(f, t, process, value):
        return {"f": f, "type": t, "process": process, "value": value, "time": 0.0}
    h = []
    for i, poison in ((1, False), (2, True), (3, True)):
        v = {"id": f"p-{i}", **({"poison": True} if poison else {})}
        h += [op("enqueue", "invoke", "p", v), op("enqueue", "ok", "p", v)]
    h += [op("dequeue", "ok", "c1", {"id": "p-1"}), op("reject", "ok", "c1", {"id": "p-2"}),
          op("dead", "ok", "collector", {"id": "p-2"}), op("dead", "ok", "collector",
                                                           {"id": "p-2"})]
    tq = checker.total_queue(h)
    assert (tq["valid"], tq["lost_ids"], tq["poison_acknowledged"], tq["dead"],
            tq["dead_twice"], tq["dead_not_poison"]) == (False, ["p-3"], 2, 1, 1, 0)
    h.append(op("dead", "ok", "collector", {"id": "p-3"}))
    assert checker.total_queue(h)["valid"] is True
    h.append(op("dead", "ok", "collector", {"id": "never-sent"}))
    assert checker.total_queue(h)["unexpected"] == 1


def test_a_rolled_back_half_must_never_be_delivered_and_is_never_lost():
    def op(f, t, process, value):
        return {"f": f, "type": t, "process": process, "value": value, "time": 0.0}
    h = []
    for vid, kind, outcome in (("h-1", "commit", "ok"), ("h-2", "check-commit", "ok"),
                               ("h-3", "rollback", "ok"), ("h-4", "check-rollback", "info"),
                               ("h-5", "check-rollback", "ok")):
        v = {"id": vid, "half": kind}
        h += [op("enqueue", "invoke", "p", v), op("enqueue", outcome, "p", v)]
    h += [op("dequeue", "ok", "c1", {"id": "h-1"}),
          op("check-back", "ok", "check-server", {"id": "h-4", "decision": "rollback"})]
    tq = checker.total_queue(h)
    # the acknowledged check-commit half never delivered is lost; rolled-back ones are not
    assert (tq["valid"], tq["lost_ids"], tq["rolled_back_delivered"]) == (False, ["h-2"], 0)
    assert (tq["halves"], tq["halves_acknowledged"], tq["check_backs"]) == (5, 4, 1)
    h.append(op("dequeue", "ok", "c1", {"id": "h-2"}))
    assert checker.total_queue(h)["valid"] is True
    h.append(op("dequeue", "ok", "c2", {"id": "h-4"}))  # whatever its enqueue's outcome
    tq = checker.total_queue(h)
    assert (tq["valid"], tq["rolled_back_delivered_ids"], tq["unexpected"]) == (False, ["h-4"], 0)


def test_order_reorderings_per_key_and_skipped_without_ordered_topic():
    h = [deq(1, "k-0", "k", 0), deq(2, "k-2", "k", 2), deq(3, "k-1", "k", 1),
         deq(4, "k-0", "k", 0),  # a redelivery: a duplicate, not a reordering
         deq(5, "j-1", "j", 1), deq(6, "j-3", "j", 3)]
    r = checker.order(h, ordered=True)
    assert r["valid"] is False and r["reorderings"] == 1
    assert r["examples"][0] == {"key": "k", "seq": 1, "after": 2, "time": 3}
    assert checker.order(h, ordered=False)["valid"] == "skipped"


def test_failover_is_fault_start_to_first_acknowledged_publish_of_each_partition():
    h = (enq(0, "p1", "a", "ok", "k", 0, partition=3)
         + [op("info", "start", 10.0, "nemesis", {"kind": "kill", "partitions": [3]})]
         + enq(10.5, "p1", "b", "info", "k", 1, partition=3, latency=3)
         + enq(14, "p1", "c", "ok", "k", 2, partition=3, latency=2.5)
         + [op("info", "stop", 18.0, "nemesis", {"kind": "kill"})])
    r = checker.failover(h)
    assert r["faults"][0]["partitions_s"] == {3: 6.5}
    assert r["max_s"] == 6.5 and r["never"] == 0
    a = checker.availability(h)
    assert a["enqueues"] == 3 and a["ok"] == 2 and a["success_rate"] == 0.6667


def test_liveness_fails_a_partition_never_writable_after_the_heal():
    assert checker.liveness({"bound_s": 30, "partitions_s": {0: 0.1}, "never": [1]})[
        "valid"] is False
    assert checker.liveness({"bound_s": 30, "partitions_s": {0: 0.1, 1: 2.0},
                             "never": []})["valid"] is True


def test_go_seconds_reads_nsqd_uptimes():
    assert go_seconds("23.114703482s") == pytest.approx(23.114703482)
    assert go_seconds("1h2m3.5s") == pytest.approx(3723.5)
    assert go_seconds("250ms") == pytest.approx(0.25) and go_seconds("0s") == 0


# ---- the replica checker on real partition folders (diskqueue, no cluster) -----------


def write_partition(path, bodies: list[bytes], epochs: list[int]) -> None:
    """A partition folder written by diskqueue, one write request per body, each with its
    commitlog entry's epoch."""
    import asyncio

    from diskqueue.queue import DiskQueue

    async def go():
        q = await DiskQueue.open(str(path))
        for body, epoch in zip(bodies, epochs):
            q.epoch = epoch
            await q.append([body])
        await q.close()
    asyncio.run(go())


def body(i: int, tag: str = "a") -> bytes:
    return json.dumps({"id": f"p1-{i}", "tag": tag}).encode()


def test_replica_checker_finds_divergent_missing_and_longer_replicas(tmp_path):
    """A follower whose record differs (same size, other body; then: same body, other
    epoch) is divergent; an ISR follower that lacks committed records is missing them; a
    replica longer than the leader is not a prefix of it (divergent past its end); an
    identical one passes. Acknowledged ids absent from every committed log are counted."""
    six = [body(i) for i in range(6)]
    write_partition(tmp_path / "lead", six, [1, 1, 1, 2, 2, 2])
    write_partition(tmp_path / "same", six, [1, 1, 1, 2, 2, 2])
    write_partition(tmp_path / "other_body", six[:2] + [body(2, "b")] + six[3:],
                    [1, 1, 1, 2, 2, 2])
    write_partition(tmp_path / "other_epoch", six, [1, 1, 1, 1, 2, 2])
    write_partition(tmp_path / "short", six[:4], [1, 1, 1, 2])
    write_partition(tmp_path / "long", six + [body(6)], [1, 1, 1, 2, 2, 2, 3])
    copies = {name: replicas.read_replica(name, str(tmp_path / name))
              for name in ("lead", "same", "other_body", "other_epoch", "short", "long")}
    lead = copies["lead"]
    assert len(lead.records) == 6 and lead.entries == 6 and lead.last_epoch == 2
    assert [v[3] for _, v in sorted(lead.records.items())] == [1, 1, 1, 2, 2, 2]
    state = {"leader": "lead", "epoch": 2, "isr": ["lead", "same", "other_body",
                                                   "other_epoch", "short"],
             "committed_offset": lead.end_offset}
    r = replicas.check_partition(0, state, copies)
    per = r["replicas"]
    assert per["same"]["divergent"] == 0 and per["same"]["missing"] == 0
    assert per["other_body"]["divergent"] == 1
    assert per["other_epoch"]["divergent"] == 1
    assert per["short"] == dict(per["short"], divergent=0, missing=2)
    assert per["long"]["in_isr"] is False and per["long"]["divergent"] == 1
    assert per["long"]["beyond_leader_end"] == 1
    assert r["divergent"] == 3 and r["missing"] == 2
    # the whole check: the verdict, and an acknowledged id no committed log holds
    collected = {"states": {0: state}, "copies": {0: {"lead": lead, "same": copies["same"]}},
                 "isr_full_s": 0.5, "exits": {}, "replicas": 2, "want": 2}
    ok = replicas.check(collected, {"p1-0", "p1-5"})
    assert ok["valid"] is True and ok["divergent"] == 0 and ok["acknowledged_not_in_log"] == 0
    assert ok["records_compared"] == 6 and ok["duplicated_in_log"] == 0
    bad = replicas.check(collected, {"p1-0", "p9-1"})
    assert bad["valid"] is False and bad["acknowledged_not_in_log_ids"] == ["p9-1"]
    assert replicas.check(None, set())["valid"] == "skipped"


# ---- real runs ----------------------------------------------------------------------


def leftovers() -> list[str]:
    """jep- namespaces, links and mounts."""
    out = []
    if os.geteuid() == 0:
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        out += [line.split()[0] for line in ns.splitlines() if line.startswith(PREFIX)]
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        out += [line.split(":")[1].strip() for line in links.splitlines()
                if line.split(":")[1].strip().startswith(PREFIX)]
        with open("/proc/mounts") as f:
            out += [line.split()[1] for line in f if line.startswith(PREFIX)]
    return out


def jepsen(store, *args: str, timeout: float) -> tuple[int, dict]:
    """Run `python -m jepsen` to the end: (exit status, summary.json)."""
    proc = subprocess.run([sys.executable, "-m", "jepsen", "--store", str(store), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    try:
        with open(os.path.join(store, "summary.json")) as f:
            summary = json.load(f)
    except OSError:
        raise AssertionError(f"no summary (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                             f"\n{proc.stderr[-3000:]}")
    return proc.returncode, summary


def test_kill_and_pause_r1_for_25_s_lose_nothing(tmp_path):
    """R=1: a killed or paused node's partitions wait for it; what was acknowledged
    survives kill -9 and the restart of the final heal."""
    store = tmp_path / "run"
    status, s = jepsen(store, "--nemesis", "kill,pause", "--time-limit", "25", "--nodes",
                       "3", "--interval", "5", "--seed", "7", timeout=300)
    tq = s["total_queue"]
    assert status == 0, s
    assert s["valid"] is True
    assert tq["lost"] == 0 and tq["unexpected"] == 0
    assert tq["acknowledged"] > 1000
    assert {f["kind"] for f in s["failover"]["faults"]} <= {"kill", "pause"}
    assert nemesis_kinds(store)[:2] == ["kill", "pause"]
    assert s["order"]["valid"] == "skipped"
    for name in ("index.html", "latency.png", "throughput.png", "history.jsonl",
                 "logs/n1-nsqd.log", "logs/clients.log"):
        assert (store / name).exists(), name
    assert leftovers() == []


def test_poison_messages_become_dead_letters_through_leader_kills_r3(tmp_path):
    """R=3, every 10th message of an nsqclient producer fails its consumer always: the
    channel (max_attempts 3) buries it, through leader kills; at the end every
    acknowledged poison message is among the dead letters, once, and every other one was
    delivered: nothing lost (dead letters count as not lost only for what they hold)."""
    status, s = jepsen(tmp_path / "run", "--nemesis", "kill", "--time-limit", "24",
                       "--nodes", "3", "--replicas", "3", "--interval", "6", "--seed", "5",
                       "--poison", "10", "--drain-quiet", "5", timeout=300)
    tq = s["total_queue"]
    assert status == 0 and s["valid"] is True, s
    assert tq["lost"] == 0 and tq["unexpected"] == 0 and tq["poison_acknowledged"] > 50
    assert tq["dead"] >= tq["poison_acknowledged"] and tq["dead_twice"] == 0, tq
    assert leftovers() == []


def test_half_messages_are_decided_through_leader_kills_r3(tmp_path):
    """R=3, every 5th message of an nsqclient producer is a half message, committed or
    rolled back by its producer or left to the check-back (nsqd --half-check-timeout 2s),
    through leader kills: every acknowledged one of a commit kind is delivered, none of a
    rollback kind ever is, and the check-backs were answered."""
    status, s = jepsen(tmp_path / "run", "--nemesis", "kill", "--time-limit", "24",
                       "--nodes", "3", "--replicas", "3", "--interval", "6", "--seed", "5",
                       "--halves", "5", "--drain-quiet", "5", timeout=300)
    tq = s["total_queue"]
    assert status == 0 and s["valid"] is True, s
    assert tq["lost"] == 0 and tq["unexpected"] == 0 and tq["rolled_back_delivered"] == 0
    assert tq["halves_acknowledged"] > 30 and tq["check_backs"] > 0, tq
    assert leftovers() == []


def test_kill_and_pause_r3_fail_over_and_lose_nothing(tmp_path):
    """R=3 (min_isr 2): a killed or paused leader's partitions move to another in-sync
    replica within seconds (lease TTL 2 s), while publishing goes on; nothing acknowledged
    is lost, nothing failed for sure is delivered."""
    status, s = jepsen(tmp_path / "run", "--nemesis", "kill,pause", "--time-limit", "30",
                       "--nodes", "3", "--replicas", "3", "--interval", "8", "--seed", "7",
                       timeout=300)
    tq = s["total_queue"]
    assert status == 0 and s["valid"] is True, s
    assert tq["lost"] == 0 and tq["unexpected"] == 0 and tq["acknowledged"] > 1000
    assert s["failover"]["never"] == 0 and s["failover"]["max_s"] < 8, s["failover"]
    assert leftovers() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the disk-full nemesis needs root (tmpfs)")
def test_broken_build_ack_before_sync_is_caught(tmp_path):
    """--test-ack-before-sync answers OK before the batch is written: when the write then
    fails (the disk-full nemesis fills the node's disk) the acknowledged messages are
    gone, and the total-queue checker fails the run (exit 1). The same run without the
    flag passes: nsqd refuses those publishes (E_PUB_FAILED), nothing acknowledged is
    lost. (How many the broken build loses depends on how soon the disk is full again: a
    write that meets a full disk checkpoints the node journal, which frees its copies.)"""
    runs = {}
    for name, flags in (("broken", ["--nsqd-flag=--test-ack-before-sync", "--drain-quiet", "3"]),
                        ("sound", [])):
        runs[name] = jepsen(tmp_path / name, "--nemesis", "disk-full", "--time-limit", "12",
                            "--nodes", "3", "--interval", "4", "--no-classic", "--seed", "5",
                            *flags, timeout=300)
        assert leftovers() == []
    status, s = runs["broken"]
    tq = s["total_queue"]
    assert status == 1 and s["valid"] is False
    assert tq["lost"] > 0 and tq["unexpected"] == 0, tq
    status, s = runs["sound"]
    tq = s["total_queue"]
    assert status == 0 and s["valid"] is True, tq
    assert tq["lost"] == 0 and tq["failed"] > 0  # refused while the disk was full


def nemesis_kinds(store) -> list[str]:
    return [json.loads(line)["value"]["kind"] for line in open(store / "history.jsonl")
            if '"process":"nemesis","value":{' in line and '"f":"start"' in line]


@pytest.mark.skipif(os.geteuid() != 0, reason="the power-cut nemesis needs root (FUSE)")
def test_power_cuts_lose_nothing_acknowledged(tmp_path):
    """Every nsqd's data on PowerFS; each fault SIGKILLs an nsqd (a partition's leader or
    a random host), drops what its file system holds unsynced and starts it again on what
    survived. nsqd syncs every batch before its OK: nothing acknowledged is lost."""
    store = tmp_path / "run"
    status, s = jepsen(store, "--nemesis", "power-cut", "--time-limit", "30", "--nodes", "3",
                       "--interval", "5", "--seed", "3", timeout=300)
    tq = s["total_queue"]
    assert status == 0 and s["valid"] is True, tq
    assert tq["lost"] == 0 and tq["unexpected"] == 0 and tq["acknowledged"] > 1000
    assert nemesis_kinds(store) == ["power-cut", "power-cut"]
    for n in ("n1", "n2", "n3"):
        assert (store / "logs" / f"{n}-powerfs.log").exists()
    assert leftovers() == []


def unsynced_run(tmp_path, nemesis: str, *extra: str) -> tuple[int, dict]:
    """A run whose topic has syncdisk 1000000: it acknowledges data it has not synced (a
    sync every 2 s)."""
    run = jepsen(tmp_path / nemesis, "--nemesis", nemesis, "--time-limit", "12", "--nodes",
                 "3", "--interval", "4", "--no-classic", "--seed", "3", "--sync-every",
                 "1000000", *extra, timeout=300)
    assert leftovers() == []
    return run


@pytest.mark.skipif(os.geteuid() != 0, reason="the power-cut nemesis needs root (FUSE)")
def test_power_cut_catches_acknowledged_unsynced_data(tmp_path):
    """A power cut drops what was acknowledged and not synced: the checker finds
    acknowledged messages lost."""
    status, s = unsynced_run(tmp_path, "power-cut", "--drain-quiet", "3")
    assert status == 1 and s["valid"] is False
    assert s["total_queue"]["lost"] > 10 and s["total_queue"]["unexpected"] == 0, s["total_queue"]


@pytest.mark.long
def test_kill_cannot_see_acknowledged_unsynced_data(tmp_path):
    """The same run under kill -9 passes (the page cache survives the process): why the
    power-cut nemesis exists."""
    status, s = unsynced_run(tmp_path, "kill")
    assert status == 0 and s["total_queue"]["lost"] == 0, s["total_queue"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the power-cut nemesis needs root (FUSE)")
def test_cleanup_after_a_killed_power_cut_harness_removes_its_mounts(tmp_path):
    """A harness SIGKILLed in a power-cut run leaves its PowerFS processes and mounts
    (source `jep-nI`) behind: `python -m jepsen --cleanup` removes them."""
    store = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "jepsen", "--store", str(store),
                             "--nemesis", "power-cut", "--time-limit", "60", "--nodes", "3"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (store / "logs" / "n3-nsqd.log").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        time.sleep(2)
        proc.kill()
        proc.wait()
        with open("/proc/mounts") as f:
            assert sum(line.startswith(PREFIX) and " fuse" in line for line in f) == 3
        out = subprocess.run([sys.executable, "-m", "jepsen", "--cleanup"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60).stdout
    finally:
        proc.kill()
        proc.wait()
        cleanup_leftovers()
    assert out.count("mount ") >= 3, out
    assert leftovers() == []
    deadline = time.monotonic() + 10
    while str(store) in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                       text=True).stdout:  # powerfs.py BACKING MOUNTPOINT
        assert time.monotonic() < deadline, "a PowerFS process is still running"
        time.sleep(0.2)


def test_interrupt_leaves_nothing_behind(tmp_path):
    """Ctrl-C (SIGINT) during the run: exit 2, no namespace, link or process left."""
    store = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "jepsen", "--store", str(store),
                             "--nemesis", "kill", "--time-limit", "60", "--nodes", "3"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 60
    while not (store / "logs" / "n3-nsqd.log").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=180)  # teardown of 3 hosts on a loaded machine
    except subprocess.TimeoutExpired:
        # where it hangs (seen once in a full run, never alone): every thread's stack
        spy = os.path.join(os.path.dirname(sys.executable), "py-spy")  # the test extras
        stacks = subprocess.run([spy, "dump", "--pid", str(proc.pid)],
                                capture_output=True, text=True).stdout
        proc.kill()  # never leave a harness running for the tests after this one
        cleanup_leftovers()
        raise AssertionError(f"no exit 180 s after SIGINT; the harness's threads:\n{stacks}")
    assert proc.returncode == 2, out[-2000:]
    assert leftovers() == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(store) not in ps


def test_cleanup_stops_a_harness_left_running_and_its_hosts(tmp_path):
    """A harness left running (as a test that timed out leaves it) would go on killing and
    restarting its hosts: the cleanup every run starts with (and `--cleanup`) stops it
    first, then every process it started, and removes every name."""
    store = tmp_path / "orphan"
    proc = subprocess.Popen([sys.executable, "-m", "jepsen", "--store", str(store),
                             "--nemesis", "kill", "--time-limit", "60", "--nodes", "3"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (store / "logs" / "n3-nsqd.log").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        time.sleep(2)
        removed = cleanup_leftovers()
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    assert f"process {proc.pid}" in removed
    assert leftovers() == []
    deadline = time.monotonic() + 10  # SIGKILLed processes are gone once reaped by init
    while str(store) in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                       text=True).stdout:
        assert time.monotonic() < deadline, "a process of the stopped run is still running"
        time.sleep(0.2)


def faults(store) -> list[dict]:
    """The nemesis's fault records, in order."""
    return [json.loads(line)["value"] for line in open(store / "history.jsonl")
            if '"process":"nemesis"' in line and '"f":"start"' in line]


def assert_replicas_agree(status: int, s: dict) -> None:
    """Nothing acknowledged lost, no divergent or missing record in any replica, every
    partition writable after the heal: the verdict of an R=3 run."""
    tq, rp = s["total_queue"], s["replicas"]
    figures = {k: tq[k] for k in ("acknowledged", "lost", "unexpected", "duplicated")}
    figures.update({k: rp.get(k) for k in ("divergent", "missing", "acknowledged_not_in_log",
                                            "isr_full_s", "records_compared")},
                   never_writable=s["liveness"].get("never"))
    assert tq["lost"] == 0 and tq["unexpected"] == 0, figures
    assert rp["valid"] is True and rp["divergent"] == 0 and rp["missing"] == 0, (
        figures, [p["examples"][:2] for p in rp["partitions"].values() if p["examples"]])
    assert s["liveness"]["valid"] is True, figures
    assert status == 0 and s["valid"] is True, figures
    assert rp["partitions_checked"] == 6 and rp["records_compared"] > 1000, figures
    # a clean stop: 0, or -15 for a node the restart nemesis started again moments before
    # the final stop (SIGTERM came before it installed its handler)
    assert set(rp["nsqd_exits"].values()) <= {0, -15}, rp["nsqd_exits"]


def r3_run(tmp_path, nemesis: str, seed: int, time_limit: int = 24,
           interval: int = 4) -> tuple[int, dict, list[dict]]:
    store = tmp_path / nemesis
    status, s = jepsen(store, "--nemesis", nemesis, "--time-limit", str(time_limit),
                       "--nodes", "3", "--replicas", "3", "--interval", str(interval),
                       "--seed", str(seed), timeout=360)
    assert leftovers() == []
    return status, s, faults(store)


def test_restart_at_once_within_the_lease_ttl_r3(tmp_path):
    """kill -9 and start again at once (a leader, a host, every nsqd): the node is started
    again within the lease TTL (2 s), while etcd still holds its lease, so it may lead
    again at the epoch it had. Nothing acknowledged may be lost and the replicas must
    agree record by record."""
    status, s, done = r3_run(tmp_path, "restart", seed=2)
    now = [f for f in done if f["mode"] != "every-down"]
    assert now and all(f["within_ttl"] and f["started_s"] < 0.5 for f in now), done
    assert_replicas_agree(status, s)


@pytest.mark.skipif(os.geteuid() != 0, reason="the power-cut nemesis needs root (FUSE)")
def test_power_cuts_of_one_two_and_all_replicas_r3(tmp_path):
    """R=3 on 3 hosts, every nsqd on PowerFS: cuts of one host, of two of a partition's
    replicas and of all three at once (the whole cluster loses what it had not synced,
    and starts again on what survived)."""
    status, s, done = r3_run(tmp_path, "power-cut", seed=SEEDS["power-cut"], time_limit=28,
                             interval=3)
    assert {f["mode"] for f in done} == {"one", "two", "all"}, done
    assert [len(f["hosts"]) for f in done if f["mode"] == "all"] == [3]
    assert_replicas_agree(status, s)


def test_etcd_paused_while_a_follower_dies_r3(tmp_path):
    """Every etcd member SIGSTOPped for 1-10 s and a follower SIGKILLed during the pause:
    its leaders' ISR shrink must go through etcd, which does not answer. After the pause
    the partition must shrink, take writes, and take the follower back."""
    status, s, done = r3_run(tmp_path, "etcd-pause", seed=SEEDS["etcd-pause"],
                             time_limit=26)
    assert any(f["mode"] == "all-members+follower-kill" and f["hosts"] for f in done), done
    assert all(1 <= f["pause_s"] <= 10 for f in done)
    assert_replicas_agree(status, s)


def test_clock_skew_is_real_and_loses_nothing_r3(tmp_path):
    """nsqd under libfaketime, etcd not: each fault sets one host's or every host's clock
    off by up to 2 s, either way, and the nsqd's own /stats shows it (its uptime moved by
    the offset); nothing acknowledged lost, the replicas agree."""
    status, s, done = r3_run(tmp_path, "clock-skew", seed=SEEDS["clock-skew"], time_limit=20)
    offsets = [(f["offsets_s"][h], f["measured_s"][h]) for f in done for h in f["offsets_s"]]
    assert offsets and all(abs(o) <= 2.0 for o, _ in offsets)
    assert any(o < 0 for o, _ in offsets) and any(o > 0 for o, _ in offsets), offsets
    assert all(abs(o - m) < 0.25 for o, m in offsets), offsets
    for f in done:  # libfaketime under the nsqds, never under etcd
        assert f["faketime"]["nsqd"] is True and f["faketime"]["etcd"] is False, f
    assert_replicas_agree(status, s)


SEEDS = {"power-cut": 5, "etcd-pause": 20, "clock-skew": 3}  # etcd-pause 20: the follower
# kill first (a 3.3 s pause); each kind's modes come in a seed-shuffled round (nemesis.py)


@pytest.mark.long
def test_every_nemesis_for_30_minutes_r3(tmp_path):
    """Every nemesis (but disk-full, which cannot share PowerFS disks with power-cut) in
    turn for 30 minutes, 5 hosts, R=3: nothing acknowledged lost, no divergence."""
    kinds = "partition,kill,pause,restart,power-cut,etcd-pause,clock-skew"
    if os.geteuid() != 0:
        kinds = "partition,kill,pause,restart,etcd-pause,clock-skew"
    status, s = jepsen(tmp_path / "long30", "--nemesis", kinds, "--time-limit", "1800",
                       "--nodes", "5", "--replicas", "3", "--interval", "10", timeout=3000)
    assert leftovers() == []
    assert_replicas_agree(status, s)


@pytest.mark.long
def test_every_nemesis_for_an_hour(tmp_path):
    status, s = jepsen(tmp_path / "long", "--nemesis", "partition,kill,pause,restart,disk-full",
                       "--long", "--nodes", "5", timeout=4500)
    assert status == 0 and s["total_queue"]["lost"] == 0, s["total_queue"]


def test_loopback_partitions_lose_nothing(tmp_path):
    """3 loopback hosts, 20 s, two partitions through the relays: nothing acknowledged
    lost, and each partition held connections between the hosts it cut."""
    store = tmp_path / "run"
    status, s = jepsen(store, "--loopback", "--nemesis", "partition", "--time-limit", "20",
                       "--nodes", "3", "--interval", "4", "--seed", "1", timeout=240)
    tq = s["total_queue"]
    assert status == 0 and s["valid"] is True, tq
    assert tq["lost"] == 0 and tq["unexpected"] == 0 and tq["acknowledged"] > 500
    assert nemesis_kinds(store) == ["partition", "partition"]
    heals = [json.loads(line)["value"] for line in open(store / "history.jsonl")
             if '"f":"stop"' in line and '"process":"nemesis"' in line]
    assert len(heals) == 2 and all(h["held_connections"] > 0 for h in heals), heals
    assert leftovers() == []
