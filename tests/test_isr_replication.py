"""isr replication runtime: a leader and followers with real DiskQueues, talking over real
TCP on 127.0.0.1 (one RpcServer per node, one event loop; tests/repl_host.py is the host)."""

import asyncio

import pytest
from repl_host import Host, States

from diskqueue.queue import DiskQueue, QueueOptions
from isr import wire
from isr.peer import Peer
from isr.state import PartitionState
from isr.wire import Kind

A, B, C = "127.0.0.1:4101", "127.0.0.1:4102", "127.0.0.1:4103"
T = "t"


async def cluster(tmp_path, nodes=(A, B, C), isr=None, min_isr=2, repl_timeout=1.0, epoch=1):
    states = States()
    states.put(T, 0, PartitionState(leader=nodes[0], isr=tuple(isr or nodes), epoch=epoch))
    hosts = [await Host(states, n, str(tmp_path / n.replace(":", "_")), min_isr=min_isr,
                        repl_timeout=repl_timeout).start() for n in nodes]
    for h in hosts[1:]:
        await h.open(T, 0)
    await hosts[0].open(T, 0)
    return states, hosts


async def stop(hosts):
    for h in hosts:
        await h.stop()


async def until(cond, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_publish_acknowledged_only_after_both_followers_synced(tmp_path):
    _, hosts = await cluster(tmp_path)
    try:
        lq = hosts[0].queues[(T, 0)]
        fqs = [h.queues[(T, 0)] for h in hosts[1:]]
        seen = []

        def check(fut):
            a = fut.result()
            seen.append([q.written_end >= a.end_offset for q in fqs])

        futs = []
        for i in range(200):
            fut = hosts[0].publish([b"m%d" % i] * (1 + i % 5))
            fut.add_done_callback(check)
            futs.append(fut)
            if i % 20 == 0:
                await asyncio.sleep(0)
        done = await asyncio.gather(*futs)
        assert len(seen) == 200 and all(all(s) for s in seen)
        end = done[-1].end_offset
        assert lq.committed_end == end
        for q in fqs:
            assert q.written_end == end
        # the followers' committed ends follow (an empty PUSH within 200 ms)
        await until(lambda: all(q.committed_end == end for q in fqs), 2)
        # the followers hold the leader's records byte for byte
        for q in fqs:
            r1, r2 = lq.reader(0), q.reader(0)
            a, b = await r1.read(10_000), await r2.read(10_000)
            assert [(x.offset, x.msg_id, x.body) for x in a] == [(x.offset, x.msg_id, x.body) for x in b]
            r1.close(), r2.close()
    finally:
        await stop(hosts)


async def test_what_arrives_while_a_batch_replicates_joins_one_next_batch(tmp_path):
    """The leader holds its next batch while one is written and uncommitted: 20 appends made
    while the followers take 0.3 s to answer a push go out as one batch (one push each)."""
    _, hosts = await cluster(tmp_path)
    try:
        lq = hosts[0].queues[(T, 0)]
        await hosts[0].publish([b"first"])
        slow = []
        for h in hosts[1:]:
            follower = h.followers[(T, 0)]
            real = follower.push

            def delayed(frame, answer, real=real):
                slow.append(frame)
                asyncio.get_running_loop().call_later(0.3, real, frame, answer)

            follower.push = delayed
        batches = lq.stats["batches"]
        futs = [hosts[0].publish([b"slow"])]
        for i in range(20):  # each alone would be a batch: the local disk is free again
            await asyncio.sleep(0.005)
            futs.append(hosts[0].publish([b"m%d" % i]))
        done = await asyncio.wait_for(asyncio.gather(*futs), 5)
        assert lq.stats["batches"] - batches == 2, lq.stats["batches"] - batches
        assert [a.first_id for a in done] == sorted(a.first_id for a in done)
        assert lq.committed_end == done[-1].end_offset
    finally:
        await stop(hosts)


async def test_a_push_of_an_older_epoch_is_fenced(tmp_path):
    _, hosts = await cluster(tmp_path, epoch=5)
    try:
        lq = hosts[0].queues[(T, 0)]
        await hosts[0].publish([b"x"])
        fq = hosts[1].queues[(T, 0)]
        before = (fq.written_end, fq.written_count)
        peer = Peer(hosts[2], B)
        raw = await lq.read_raw(0, 1 << 20)
        header = {"topic": T, "partition": 0, "epoch": 4, "leader": C, "offset": fq.written_end,
                  "count": fq.written_count, "n": raw.n_entries, "data_len": len(raw.data),
                  "commit": [0, 0]}
        r = await peer.request(Kind.PUSH, header, raw.entries + raw.data)
        assert r.kind is Kind.ERROR and r.header["code"] == wire.E_STALE_EPOCH
        assert r.header["epoch"] == 6  # the leader's own epoch: the state's, raised by one
        assert (fq.written_end, fq.written_count) == before
        # a CHANNELS of an older epoch too
        r = await peer.request(Kind.CHANNELS, {"topic": T, "partition": 0, "epoch": 1,
                                               "channels": {"c": {}}})
        assert r.header["code"] == wire.E_STALE_EPOCH and (T, 0) not in hosts[1].channels
        await peer.close()
    finally:
        await stop(hosts)


async def test_a_stopped_follower_is_dropped_and_the_write_completes(tmp_path):
    states, hosts = await cluster(tmp_path, repl_timeout=0.5)
    try:
        lq = hosts[0].queues[(T, 0)]
        await hosts[0].publish([b"before"])
        await hosts[2].rpc.stop()
        a = await asyncio.wait_for(hosts[0].publish([b"after"]), 3)
        s = states.states[(T, 0)]
        assert s.isr == (A, B) and s.catchup == (C,) and s.epoch == 3  # 2: the leadership's
        assert lq.committed_end == a.end_offset == hosts[1].queues[(T, 0)].written_end
        assert hosts[0].leaders[(T, 0)].writable
        await until(lambda: lq.epoch == 3, 1)  # new entries carry the new epoch
    finally:
        await stop(hosts)


async def test_a_sigstopped_follower_times_out_and_is_dropped(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    states = States()
    state = PartitionState(leader=A, isr=(A, B, C), epoch=1)
    states.put(T, 0, state)
    hosts = [await Host(states, n, str(tmp_path / n.replace(":", "_")), min_isr=2,
                        repl_timeout=0.5).start() for n in (A, B)]
    here = os.path.dirname(__file__)
    child = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, os.path.join(here, "repl_host.py"), str(tmp_path / "c"), C, T, "0", A,
         states.addresses[A], state.encode().decode()],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=os.path.dirname(here),
        env={**os.environ, "PYTHONPATH": os.path.dirname(here)})
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 20)
        assert line.startswith(b"ready"), line
        states.addresses[C] = f"127.0.0.1:{int(line.split()[1])}"
        await hosts[1].open(T, 0)
        await hosts[0].open(T, 0)
        await asyncio.wait_for(hosts[0].publish([b"all three"]), 3)
        assert states.states[(T, 0)].isr == (A, B, C)
        os.kill(child.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        await asyncio.wait_for(hosts[0].publish([b"two"]), 5)
        took = time.monotonic() - t0
        assert 0.45 <= took < 2.0, took
        assert states.states[(T, 0)].isr == (A, B)
        os.kill(child.pid, signal.SIGCONT)
        await asyncio.wait_for(hosts[0].publish([b"still two"]), 3)
        assert json.dumps(list(states.states[(T, 0)].catchup)) == json.dumps([C])
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()
        await stop(hosts)


async def test_below_min_isr_parked_batches_fail_and_appends_are_refused(tmp_path):
    from diskqueue.errors import NotCommitted
    states, hosts = await cluster(tmp_path, repl_timeout=0.5, min_isr=2)
    try:
        lq = hosts[0].queues[(T, 0)]
        leader = hosts[0].leaders[(T, 0)]
        await hosts[0].publish([b"ok"])
        # stall both followers: their pushes are never acked (a server that reads, never answers)
        for h in hosts[1:]:
            h.followers[(T, 0)].push = _never
        fut = hosts[0].publish([b"parked"])
        with pytest.raises(NotCommitted):
            await asyncio.wait_for(fut, 5)
        s = states.states[(T, 0)]
        assert s.isr == (A,) and set(s.catchup) == {B, C}
        assert not leader.writable and "below min_isr 2" in leader.reason
        # the data stays in the log, uncommitted
        assert lq.written_end > lq.committed_end
    finally:
        await stop(hosts)


def _never(frame, answer):
    """A follower's `push` that never answers (the PUSH is read, never acked)."""


async def records(q):
    r = q.reader(q.start_offset)
    out = []
    while batch := await r.read(100_000):
        out += [(x.offset, x.msg_id, x.body) for x in batch]
    r.close()
    return out


async def test_a_diverged_replica_truncates_to_the_new_leader_and_joins(tmp_path):
    states, hosts = await cluster(tmp_path, min_isr=1)
    a, b, _ = hosts
    try:
        aq = a.queues[(T, 0)]
        await a.publish([b"m1", b"m2"])
        await a.publish([b"m3"])
        # A writes a tail its followers never get (a push lost as A is cut off), then dies
        followers = [h.followers[(T, 0)] for h in hosts[1:]]
        for f in followers:
            f.push = lambda frame, answer: None  # the push never arrives
        tail = a.publish([b"lost1", b"lost2"])
        await until(lambda: aq.written_end > hosts[1].queues[(T, 0)].written_end)
        await a.stop()
        for f in followers:
            del f.push
        with pytest.raises(Exception, match="closed|closing|failed"):
            await tail
        # failover: B leads at epoch 2 with C; A is outside the ISR
        states.put(T, 0, PartitionState(leader=B, isr=(B, C), catchup=(A,), epoch=2))
        await b.lead(T, 0)
        bq = b.queues[(T, 0)]
        await b.publish([b"n1"])
        await b.publish([b"n2", b"n3"])
        # A comes back and follows B: its epoch-1 tail is cut, B's epoch-2 records fetched
        a2 = await Host(states, A, a.path, min_isr=1).start()
        hosts[0] = a2
        a2q = await a2.open(T, 0)
        await until(lambda: A in states.states[(T, 0)].isr)
        assert a2.followers[(T, 0)].stats["truncations"] == 1
        await b.publish([b"n4"])
        await until(lambda: a2q.committed_end == bq.committed_end, 2)
        assert await records(a2q) == await records(bq)
        bodies = [x[2] for x in await records(a2q)]
        assert bodies == [b"m1", b"m2", b"m3", b"n1", b"n2", b"n3", b"n4"]
        s = states.states[(T, 0)]
        assert s.isr == (B, C, A) and s.catchup == () and s.epoch == 4
    finally:
        await stop(hosts)


@pytest.mark.parametrize("megabytes", [pytest.param(100, marks=pytest.mark.long), 16])
async def test_a_replica_far_behind_catches_up_in_chunks_while_publishes_go_on(tmp_path,
                                                                                 megabytes):
    states = States()
    states.put(T, 0, PartitionState(leader=A, isr=(A, B), catchup=(C,), epoch=1))
    hosts = [await Host(states, n, str(tmp_path / n.replace(":", "_")), min_isr=1).start()
             for n in (A, B, C)]
    try:
        await hosts[1].open(T, 0)
        aq = await hosts[0].open(T, 0)
        body = b"x" * 100_000
        for _ in range(megabytes):
            await hosts[0].publish([body] * 10)
        published = 0

        async def publish():
            nonlocal published
            while True:
                await hosts[0].publish([b"during"])
                published += 1
                await asyncio.sleep(0.005)

        pub = asyncio.create_task(publish())
        cq = await hosts[2].open(T, 0)
        await until(lambda: C in states.states[(T, 0)].isr, 120)
        pub.cancel()
        await asyncio.gather(pub, return_exceptions=True)
        assert published > 0
        fetches = hosts[2].followers[(T, 0)].stats["fetches"]
        assert fetches >= megabytes  # 1 MiB chunks
        await hosts[0].publish([b"after"])
        await until(lambda: cq.committed_end == aq.committed_end, 2)
        assert await records(cq) == await records(aq)
    finally:
        await stop(hosts)


async def test_channel_states_reach_the_followers_latest_wins_at_most_every_200ms(tmp_path):
    _, hosts = await cluster(tmp_path)
    try:
        leader = hosts[0].leaders[(T, 0)]
        got = {B: [], C: []}
        for h in hosts[1:]:
            h.channels_received = lambda t, p, ch, node=h.node_id: got[node].append(ch)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(100):
            leader.send_channels({"ch": {"confirmed": i}})
            await asyncio.sleep(0.01)
        elapsed = loop.time() - t0
        await until(lambda: all(g and g[-1] == {"ch": {"confirmed": 99}} for g in got.values()), 1)
        for g in got.values():
            assert len(g) <= elapsed / 0.2 + 2, len(g)
            assert [x["ch"]["confirmed"] for x in g] == sorted(x["ch"]["confirmed"] for x in g)
        assert leader.stats["channels_sent"] == len(got[B])
    finally:
        await stop(hosts)


async def test_states_of_two_channels_sent_within_one_interval_both_arrive(tmp_path):
    """send_channels keeps the latest state per channel, not only the last call's."""
    _, hosts = await cluster(tmp_path)
    try:
        leader = hosts[0].leaders[(T, 0)]
        got = {B: {}, C: {}}
        for h in hosts[1:]:
            h.channels_received = lambda t, p, ch, node=h.node_id: got[node].update(ch)
        leader.send_channels({"one": {"confirmed": 1}})
        leader.send_channels({"two": {"confirmed": 2}})
        leader.send_channels({"one": {"confirmed": 3}})
        await until(lambda: all(len(g) == 2 for g in got.values()), 1)
        for g in got.values():
            assert g == {"one": {"confirmed": 3}, "two": {"confirmed": 2}}
    finally:
        await stop(hosts)


async def test_channel_states_over_one_header_go_in_several_frames(tmp_path):
    """States whose JSON together passes a frame's header limit (64 KiB) go out in as many
    CHANNELS frames as they need; one too large for a frame of its own is left out, and
    the leader goes on (before: ValueError in its tick task, which stopped sending)."""
    _, hosts = await cluster(tmp_path)
    try:
        leader = hosts[0].leaders[(T, 0)]
        got = {B: {}, C: {}}
        for h in hosts[1:]:
            h.channels_received = lambda t, p, ch, node=h.node_id: got[node].update(ch)
        big = {f"c{i}": {"confirmed": i, "pad": "x" * 30_000} for i in range(4)}
        leader.send_channels({**big, "huge": {"confirmed": 9, "pad": "y" * 70_000}})
        await until(lambda: all(len(g) == 4 for g in got.values()), 2)
        assert all(g == big for g in got.values())
        leader.send_channels({"after": {"confirmed": 1}})
        await until(lambda: all("after" in g for g in got.values()), 2)
        assert all("huge" not in g for g in got.values())
    finally:
        await stop(hosts)


async def test_push_channels_returns_once_every_isr_follower_stored_the_state(tmp_path):
    """An ordered FIN's push: awaited, straight to the ISR (no 200 ms timer); a follower that
    is gone is dropped from the ISR (CAS) and the push then completes without it."""
    states, hosts = await cluster(tmp_path, min_isr=1, repl_timeout=0.5)
    try:
        leader = hosts[0].leaders[(T, 0)]
        got = {B: [], C: []}
        for h in hosts[1:]:
            h.channels_received = lambda t, p, ch, node=h.node_id: got[node].append(ch)
        await asyncio.wait_for(leader.push_channels({"o": {"confirmed": 7}}), 1)
        assert got[B] == got[C] == [{"o": {"confirmed": 7}}]
        await hosts[2].stop()  # C is gone: the push waits for the CAS that drops it
        await asyncio.wait_for(leader.push_channels({"o": {"confirmed": 8}}), 5)
        assert got[B][-1] == {"o": {"confirmed": 8}}
        assert C not in states.states[(T, 0)].isr
        assert leader.stats["channels_pushed"] == 2
    finally:
        await stop(hosts)


async def test_a_stalled_partition_never_holds_back_another_on_the_same_connection(tmp_path):
    """Partitions 0 and 1 share the leader's connection to B. B's partition 0 stops
    answering: partition 0 drops B after repl_timeout; partition 1 keeps B in its ISR and
    its publishes complete at their usual pace meanwhile."""
    states = States()
    for p in (0, 1):
        states.put(T, p, PartitionState(leader=A, isr=(A, B), epoch=1))
    hosts = [await Host(states, n, str(tmp_path / n.replace(":", "_")), min_isr=1,
                        repl_timeout=0.5).start() for n in (A, B)]
    try:
        for p in (0, 1):
            await hosts[1].open(T, p)
            await hosts[0].open(T, p)
        await hosts[0].publish([b"x"])
        await hosts[0].publish([b"x"], partition=1)
        hosts[1].followers[(T, 0)].push = _never
        stalled = hosts[0].publish([b"stalled"])
        for i in range(30):  # partition 1 goes on (each ACK within repl_timeout, see below)
            await asyncio.wait_for(hosts[0].publish([b"p1 %d" % i], partition=1), 3)
            await asyncio.sleep(0.02)
        await asyncio.wait_for(stalled, 3)
        assert hosts[0].leaders[(T, 0)].stats["isr_shrinks"] == 1  # (B may rejoin since)
        assert hosts[0].leaders[(T, 1)].stats["isr_shrinks"] == 0
        assert states.states[(T, 1)].isr == (A, B)
    finally:
        await stop(hosts)


async def test_a_new_leader_commits_what_the_isr_holds_without_waiting_for_a_publish(tmp_path):
    states, hosts = await cluster(tmp_path)
    a, b, c = hosts
    try:
        aq, bq = a.queues[(T, 0)], b.queues[(T, 0)]
        await a.publish([b"m"])
        await a.stop()  # before a commit update told B of the commit
        assert bq.committed_end == 0 < bq.written_end == aq.written_end
        states.put(T, 0, PartitionState(leader=B, isr=(B, C), catchup=(A,), epoch=2))
        await b.lead(T, 0)
        await until(lambda: bq.committed_end == bq.written_end, 1)
        await until(lambda: c.queues[(T, 0)].committed_end == bq.written_end, 1)
    finally:
        await stop(hosts)


async def test_a_stale_leader_commits_nothing_and_steps_down(tmp_path):
    """A is cut off (it hears nothing of the failover); B leads at epoch 2 with C. A's
    publish is pushed to B (no longer a follower) and C (fenced at epoch 2): it fails,
    A commits nothing more and stops taking publishes; B's and C's logs never see it."""
    from diskqueue.errors import NotCommitted
    states, hosts = await cluster(tmp_path, min_isr=2)
    a, b, _ = hosts
    try:
        aq, bq, cq = (h.queues[(T, 0)] for h in hosts)
        await hosts[0].publish([b"before"])
        states.hosts.remove(a)  # A is cut off from the state
        states.put(T, 0, PartitionState(leader=B, isr=(B, C), catchup=(A,), epoch=2))
        await b.lead(T, 0)
        await hosts[1].publish([b"new leader"])
        committed = aq.committed_end
        with pytest.raises(NotCommitted):
            await asyncio.wait_for(hosts[0].publish([b"stale"]), 5)
        assert aq.committed_end == committed
        leader = a.leaders[(T, 0)]
        assert not leader.writable and "has seen epoch" in leader.reason
        await until(lambda: cq.committed_end == bq.committed_end, 2)
        for q in (bq, cq):
            assert [x[2] for x in await records(q)] == [b"before", b"new leader"]
            assert q.written_end == bq.written_end
    finally:
        await stop(hosts)


async def test_the_fence_survives_a_restart(tmp_path):
    """A follower that saw epoch 7 refuses epoch 6 after a restart, though its log holds
    nothing of epoch 7 (the fence is persisted before anything of the epoch is taken)."""
    states, hosts = await cluster(tmp_path, epoch=5)
    try:
        bq = hosts[1].queues[(T, 0)]
        peer = Peer(hosts[2], B)
        header = {"topic": T, "partition": 0, "epoch": 7, "leader": A, "offset": 0,
                  "count": 0, "n": 0, "data_len": 0, "commit": [0, 0]}
        await peer.request(Kind.PUSH, header)  # (A is not at 7: the reconcile fails)
        await peer.close()
        assert hosts[1].followers[(T, 0)].epoch == 7 and bq.last_epoch < 7
        await hosts[1].stop()
        hosts[1] = await Host(states, B, hosts[1].path).start()
        await hosts[1].open(T, 0)
        assert hosts[1].followers[(T, 0)].epoch == 7
        peer = Peer(hosts[2], B)
        r = await peer.request(Kind.PUSH, {**header, "epoch": 6})
        assert r.header["code"] == wire.E_STALE_EPOCH and r.header["epoch"] == 7
        await peer.close()
    finally:
        await stop(hosts)


async def test_a_replica_behind_the_leaders_retained_start_restarts_there_and_joins(tmp_path):
    """A replica whose whole log is older than the leader's start (retention dropped the
    rest there) gets E_OUT_OF_RANGE: it drops its log, takes the history from the leader's
    start, and joins (it retried forever before)."""
    states = States()
    states.put(T, 0, PartitionState(leader=A, isr=(A, B), catchup=(C,), epoch=1))
    hosts = [await Host(states, n, str(tmp_path / n.replace(":", "_")), min_isr=1).start()
             for n in (A, B, C)]
    try:
        await hosts[1].open(T, 0)
        opts = QueueOptions(partition=0, replicated=True, segment_bytes=4096)
        aq = await hosts[0].open(T, 0, await DiskQueue.open(str(tmp_path / "a" / "0"), opts))
        for i in range(5):
            await hosts[0].publish([b"early %d" % i])
        old = await DiskQueue.open(str(tmp_path / "c" / "0"), opts)
        prefix = await aq.read_raw(0, 1 << 20)  # C held the leader's first records, then left
        await old.append_raw(prefix.offset, prefix.count, prefix.entries, prefix.data)
        old.commit_to(old.written_end, old.written_count)
        for i in range(40):
            await hosts[0].publish([b"m%03d" % i + b"x" * 300] * 3)
        start = await aq.retain(before_offset=aq.committed_end)
        assert start > old.written_end
        cq = await hosts[2].open(T, 0, old)
        await until(lambda: C in states.states[(T, 0)].isr, 10)
        assert hosts[2].followers[(T, 0)].stats["restarts"] == 1
        assert (cq.start_offset, cq.start_count) == (aq.start_offset, aq.start_count)
        await hosts[0].publish([b"after"])
        await until(lambda: cq.committed_end == aq.committed_end, 2)
        assert await records(cq) == await records(aq)
    finally:
        await stop(hosts)


async def test_a_refused_push_of_the_leaders_own_older_epoch_does_not_depose_it(tmp_path):
    """E_STALE_EPOCH from a follower that has seen the leader's own epoch (a push sent
    before the leader's ISR change raised it) fails that follower only; one that has seen a
    newer epoch deposes the leader. (A one-way partition in jepsen left a partition
    leaderless: its only ISR member stepped down on such a refusal.)"""
    states, hosts = await cluster(tmp_path, min_isr=1)
    try:
        leader = hosts[0].leaders[(T, 0)]
        epoch = leader.state.epoch

        def refusal(seen):
            return wire.Frame(Kind.ERROR, 0, {"code": wire.E_STALE_EPOCH, "message": "stale",
                                              "epoch": seen})

        leader._acked(B, refusal(epoch))
        assert not leader.closed and leader.core.followers[B].failed
        leader._acked(C, refusal(epoch + 1))
        assert leader.closed
    finally:
        await stop(hosts)


async def test_a_leader_started_again_within_its_lease_leads_in_a_new_epoch(tmp_path):
    """Issue 28 item 1: the followers hold a batch X the leader pushed but lost (killed
    before its own write was durable); the leader starts again while etcd still names it.
    It takes a new epoch first, so its next batch Y (as long as X, at X's place) is not
    taken for X: the followers cut X and hold Y, as the leader does."""
    states, hosts = await cluster(tmp_path, min_isr=2)
    a = hosts[0]
    try:
        lq = a.queues[(T, 0)]
        first = a.leaders[(T, 0)]
        scratch = await DiskQueue.open(str(tmp_path / "scratch"), QueueOptions(partition=0))
        await scratch.set_epoch(first.state.epoch)
        await scratch.append([b"X" * 16])
        x = await scratch.read_raw(0, 1 << 20)
        await scratch.close()
        for h in hosts[1:]:
            peer = Peer(a, h.node_id)
            r = await peer.request(Kind.PUSH, {
                "topic": T, "partition": 0, "epoch": first.state.epoch, "leader": A, "offset": 0,
                "count": 0, "n": x.n_entries, "data_len": len(x.data), "commit": [0, 0]},
                x.entries + x.data)
            assert r.kind is Kind.ACK, r.header
            await peer.close()
        await a.leaders.pop((T, 0)).close("killed")  # the leader's own write of X was lost
        assert lq.written_end == 0
        again = await a.open(T, 0, lq)  # noqa: F841  (leads again on the same queue)
        leader = a.leaders[(T, 0)]
        assert leader.state.epoch > first.state.epoch == states.states[(T, 0)].epoch - 1
        y = await asyncio.wait_for(a.publish([b"Y" * 16]), 5)
        assert y.end_offset == x.end[0]
        for h in hosts[1:]:
            q = h.queues[(T, 0)]
            await until(lambda q=q: q.committed_end == y.end_offset, 2)
            assert [body for *_, body in await records(q)] == [b"Y" * 16]
    finally:
        await stop(hosts)


async def test_a_shrink_while_etcd_does_not_answer_never_wedges_the_partition(tmp_path):
    """Issue 28 item 2: a follower fails while etcd refuses every call (not a conflict):
    what waits is answered (not writable: the ISR change cannot be written) instead of
    waiting for ever, and once etcd answers again the follower is dropped and publishing
    goes on."""
    from diskqueue.errors import NotCommitted
    states, hosts = await cluster(tmp_path, repl_timeout=0.3, min_isr=2)
    a = hosts[0]
    away = True
    cas, read = states.cas, getattr(a, "read_state", None)

    async def cas_away(*args):
        if away:
            raise ConnectionError("etcd unavailable")
        return await cas(*args)

    async def read_away(*args):
        if away:
            raise ConnectionError("etcd unavailable")
        return await read(*args)

    try:
        lq = a.queues[(T, 0)]
        await a.publish([b"before"])
        states.cas, a.read_state = cas_away, read_away
        await hosts[2].rpc.stop()
        with pytest.raises(NotCommitted):
            await asyncio.wait_for(a.publish([b"waits"]), 5)
        leader = a.leaders[(T, 0)]
        assert not leader.writable and "etcd" in leader.reason
        away = False
        await until(lambda: states.states[(T, 0)].isr == (A, B), 5)
        await until(lambda: leader.writable, 2)
        done = await asyncio.wait_for(a.publish([b"after"]), 5)
        assert lq.committed_end == done.end_offset
    finally:
        await stop(hosts)


async def test_a_leader_that_hangs_never_holds_the_replica(tmp_path):
    """Issue 28 item 7: the partition's state names a leader that hangs (it answers the
    replication HELLO, then nothing, as a node SIGSTOPped after its peers connected) with
    C catching up, so C's catch-up request to it waits; then B takes the partition over. C's request ends by its
    deadline, C catches up from B and joins its ISR, holding what B commits. (Before, C's
    request had no deadline and its catch-up went on with the old leader: C never rejoined,
    the test timing out on fc3bfe2.)"""
    H = "127.0.0.1:4109"

    async def frozen(reader, writer):
        decoder = wire.Decoder()
        while chunk := await reader.read(65536):
            for frame in decoder.feed(chunk):
                if frame.kind is Kind.HELLO:
                    writer.write(wire.encode(Kind.OK, frame.rid, {"node": H,
                                                                  "version": wire.VERSION}))

    hung = await asyncio.start_server(frozen, "127.0.0.1", 0)
    states, hosts = await cluster(tmp_path, min_isr=1)
    a, b, c = hosts
    try:
        states.addresses[H] = "127.0.0.1:%d" % hung.sockets[0].getsockname()[1]
        await a.publish([b"m1"])
        await until(lambda: c.queues[(T, 0)].committed_count == 1)
        await a.stop()
        states.put(T, 0, PartitionState(leader=H, isr=(H, B), catchup=(C,), epoch=5))
        await asyncio.sleep(0.3)  # B and C ask H where epoch 1 ends; H never answers
        states.put(T, 0, PartitionState(leader=B, isr=(B,), catchup=(C, A), epoch=6))
        await asyncio.wait_for(b.lead(T, 0), 10)
        bq = b.queues[(T, 0)]
        await b.publish([b"n1"])
        await until(lambda: C in states.states[(T, 0)].isr, 10)
        await asyncio.wait_for(b.publish([b"n2"]), 5)
        cq = c.queues[(T, 0)]
        await until(lambda: cq.committed_end == bq.committed_end, 5)
        assert [x[2] for x in await records(cq)] == [b"m1", b"n1", b"n2"]
    finally:
        hung.close()
        await asyncio.wait_for(stop([b, c]), 10)
