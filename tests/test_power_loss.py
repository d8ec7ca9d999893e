"""Every acknowledged message, topic and channel survives a power cut, not only kill -9.

nsqd runs with its --data-path on PowerFS (tests/powerfs.py), which holds the page cache
itself and drops what was not synced on a cut. Each round: publishers over TCP (PUB, MPUB,
DPUB) and HTTP (/pub, /pub?defer=, /mpub), topics and channels being created
(/topic/create, /channel/create, SUB), consumers FINning; at a random moment kill -9 nsqd,
cut the power, and start nsqd again on what survived. Segments are 64 KiB, so new
segment files are made during the run; the node journal is checkpointed every 64 KiB
(about 3 checkpoints a round, each syncing the old file's segments on its own thread
while the rounds go on: a build whose checkpoint deleted the old file without those
syncs lost acknowledged messages in every round); and cursors are saved every 100 ms, so
a channel's `confirmed` often covers messages moved to its delay store before the cut.
Then:
- every topic and channel acknowledged as created is in /stats;
- every channel delivers every message whose publish was acknowledged and was sent after
  the channel's creation was acknowledged (minus those its consumers FINished: those may
  or may not come back). A witness channel `w` made on each topic, never read before the
  cut, gets them all; DPUB defers up to 1.5 s, past the --delay-threshold of 500 ms, so some
  go through the channels' delay stores.
Rounds go on from what the previous one left (recovery on top of recovery).

The test fails when it should (the negative runs, tests here, assert that the checker
DOES find losses):
- `--sync-every 1000000` acknowledges without syncing: acknowledged messages are lost;
- PowerFS with `--no-dir-sync` (a folder's fsync syncs nothing): a new topic's folder,
  the folders inside it, its segment files, its delay store's folder never reach the disk;
- PowerFS ignoring the fsync of the node journal's files (`.jnl`, nsqd's default): the
  rounds' durable batches were acknowledged on that one sync.

Found by it (each makes this test fail again when undone):
- nsqd.meta.sqlite was never synced (sqlitedict sets `synchronous=OFF`): every topic and
  channel made since the start was gone after a cut. MetaStore now sets EXTRA.
- no folder was synced into its parent: the messages of every new topic (its folder, the
  partition's folder, `data/`, `commitlog/`) and the deferred messages of new channels
  (`delay/`) were gone after a cut. Folders are now made with `diskqueue.atomic.make_dirs`.

Each round prints one line (acknowledged messages, topics, channels, what was checked).
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp
import pytest

from nsqclient.conn import Connection, NSQError
from powerfs import PowerFS
from servers import NsqdProcess
from test_nsqd_durability import drain

CI_ROUNDS = 12
LONG_ROUNDS = 300
BASE_TOPICS = ("base0", "base1")  # long-lived: consumers FIN on their channel `c`
FAILED = (ConnectionError, OSError, NSQError, aiohttp.ClientError, asyncio.TimeoutError)


class Ledger:
    """What nsqd acknowledged. `tick()` orders events: a publish counts for a channel only
    when it was sent after the channel's creation was acknowledged."""

    def __init__(self):
        self.clock = 0
        self.topics: set[str] = set()
        self.channels: dict[tuple[str, str], int] = {}  # -> tick of the acknowledgement
        self.ready: list[str] = list(BASE_TOPICS)  # topics publishers may write to
        self.published: list[tuple[str, int, bytes]] = []  # (topic, tick sent, body)
        self.finished: dict[tuple[str, str], set[bytes]] = {}

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def created(self, topic: str, channel: str | None, at: int) -> None:
        self.topics.add(topic)
        if channel is not None:
            self.channels.setdefault((topic, channel), at)

    def expected(self) -> dict[tuple[str, str], set[bytes]]:
        out = {}
        for (topic, channel), made in self.channels.items():
            done = self.finished.get((topic, channel), set())
            want = {b for t, sent, b in self.published if t == topic and sent > made} - done
            if want:
                out[(topic, channel)] = want
        return out

    def checked(self) -> None:
        """The round's messages were all drained: the next round expects only its own."""
        self.published = []
        self.finished = {}
        self.ready = list(BASE_TOPICS)


async def http_post(session, proc, path: str, data: bytes = b"") -> bool:
    async with session.post(f"http://{proc.http_address}{path}", data=data) as r:
        return r.status == 200


async def creator(proc, ledger: Ledger, rnd: int, rng: random.Random, session) -> None:
    """A few new topics (each with its witness channel `w` before any publish to it) and
    late channels on topics being written, by HTTP or by SUB."""
    for k in range(3):
        await asyncio.sleep(rng.uniform(0.02, 0.3))
        if k != 1:
            topic = f"r{rnd}n{k}"
            if rng.random() < 0.5:
                if not await http_post(session, proc, f"/topic/create?topic={topic}"):
                    return
                ledger.created(topic, None, ledger.tick())
                if not await http_post(session, proc, f"/channel/create?topic={topic}&channel=w"):
                    return
            else:
                conn = await Connection("127.0.0.1", proc.tcp_port).connect()
                try:
                    await conn.sub(topic, "w")
                finally:
                    await conn.close()
            ledger.created(topic, "w", ledger.tick())
            ledger.ready.append(topic)
        else:
            topic, channel = rng.choice(ledger.ready), f"late{rnd}n{k}"
            if rng.random() < 0.5:
                if not await http_post(session, proc,
                                       f"/channel/create?topic={topic}&channel={channel}"):
                    return
            else:
                conn = await Connection("127.0.0.1", proc.tcp_port).connect()
                try:
                    await conn.sub(topic, channel)
                finally:
                    await conn.close()
            ledger.created(topic, channel, ledger.tick())


async def tcp_publisher(proc, ledger: Ledger, rnd: int, n: int, rng: random.Random) -> None:
    conn = await Connection("127.0.0.1", proc.tcp_port).connect()
    try:
        for seq in range(1_000_000):
            topic, kind = rng.choice(ledger.ready), rng.random()
            sent = ledger.tick()
            if kind < 0.5:
                bodies = [b"r%dt%d-%d-" % (rnd, n, seq) + b"x" * rng.randrange(200)]
                await conn.pub(topic, bodies[0])
            elif kind < 0.8:
                bodies = [b"r%dt%d-%d-%d" % (rnd, n, seq, i) for i in range(rng.randint(2, 20))]
                await conn.mpub(topic, bodies)
            else:
                bodies = [b"r%dt%d-%d-deferred" % (rnd, n, seq)]
                await conn.dpub(topic, rng.randrange(1500), bodies[0])
            ledger.published += [(topic, sent, b) for b in bodies]
    finally:
        await conn.close()


async def http_publisher(proc, ledger: Ledger, rnd: int, rng: random.Random, session) -> None:
    for seq in range(1_000_000):
        topic, kind = rng.choice(ledger.ready), rng.random()
        sent = ledger.tick()
        if kind < 0.4:
            bodies = [b"r%dh-%d" % (rnd, seq)]
            ok = await http_post(session, proc, f"/pub?topic={topic}", bodies[0])
        elif kind < 0.6:
            bodies = [b"r%dh-%d-deferred" % (rnd, seq)]
            ok = await http_post(session, proc, f"/pub?topic={topic}&defer={rng.randrange(1500)}",
                                 bodies[0])
        else:
            bodies = [b"r%dh-%d-%d" % (rnd, seq, i) for i in range(rng.randint(2, 20))]
            ok = await http_post(session, proc, f"/mpub?topic={topic}", b"\n".join(bodies))
        if not ok:
            return
        ledger.published += [(topic, sent, b) for b in bodies]


async def consumer(proc, ledger: Ledger, topic: str) -> None:
    """Makes the topic's witness `w` (by SUB, then leaves it), then FINs on channel `c`."""
    conn = await Connection("127.0.0.1", proc.tcp_port).connect()
    try:
        await conn.sub(topic, "w")
        ledger.created(topic, "w", ledger.tick())
    finally:
        await conn.close()
    conn = await Connection("127.0.0.1", proc.tcp_port).connect()
    try:
        await conn.sub(topic, "c", rdy=50)
        ledger.created(topic, "c", ledger.tick())
        finished = ledger.finished.setdefault((topic, "c"), set())
        while True:
            msg = await conn.messages.get()
            finished.add(msg.body)  # before the FIN: a FIN sent may or may not count
            msg.fin()
    finally:
        await conn.close()


async def run_until_killed(proc, ledger: Ledger, rnd: int, rng: random.Random) -> None:
    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(t) for t in (
            creator(proc, ledger, rnd, rng, session),
            *(tcp_publisher(proc, ledger, rnd, n, random.Random(rng.random())) for n in range(3)),
            http_publisher(proc, ledger, rnd, random.Random(rng.random()), session),
            *(consumer(proc, ledger, t) for t in BASE_TOPICS))]
        await asyncio.sleep(rng.uniform(0.2, 1.0))  # the cut point
        proc.kill()
        for task in tasks:
            task.cancel()  # consumers wait for messages that will not come
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if not isinstance(result, (asyncio.CancelledError, *FAILED)) and result is not None:
                raise result


async def check(proc, ledger: Ledger) -> tuple[list[str], int]:
    """What the restarted nsqd lost of what it acknowledged; and how many messages were
    checked."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{proc.http_address}/stats?format=json") as r:
            stats = await r.json()
    now = {t["topic_name"]: {c["channel_name"] for c in t["channels"]} for t in stats["topics"]}
    problems = [f"topic {t} (acknowledged as created) is gone" for t in sorted(ledger.topics)
                if t not in now]
    problems += [f"channel {t}/{c} (acknowledged as created) is gone"
                 for t, c in sorted(ledger.channels) if c not in now.get(t, ())]
    problems += [f"topic {t['topic_name']} partition {p['partition']} does not serve: {p['error']}"
                 for t in stats["topics"] for p in t.get("partitions", ()) if p.get("error")]
    expected = ledger.expected()
    seen = await asyncio.gather(*(drain(proc.tcp_port, t, c, want, idle=5)
                                  for (t, c), want in expected.items()), return_exceptions=True)
    for ((t, c), want), got in zip(expected.items(), seen):
        if isinstance(got, NSQError):  # a partition that does not serve: all of it is lost
            got = {}
        elif isinstance(got, BaseException):
            raise got
        lost = want - got.keys()
        if lost:
            problems.append(f"{t}/{c}: {len(lost)} of {len(want)} acknowledged messages lost, "
                            f"e.g. {sorted(lost)[:3]}")
    ledger.checked()
    return problems, sum(map(len, expected.values()))


async def power_cuts(tmp_path, rounds: int, *nsqd_args: str, dir_sync: bool = True,
                     seed: int | None = None, stop_at_first: bool = False,
                     unsynced_suffix: str = "") -> list[str]:
    """Run `rounds` power cuts; return what was lost (each line names its round and seed).

    The node is first set up on a mount that syncs folders (start, clean stop, unmount: all
    of it on disk), so `dir_sync=False` only affects what the rounds create."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    disk, mnt = str(tmp_path / "disk"), str(tmp_path / "mnt")
    proc = NsqdProcess(os.path.join(mnt, "data"), "--delay-threshold", "500ms",
                       "--segment-bytes", "65536", "--checkpoint-interval", "100ms",
                       "--journal-checkpoint-bytes", "65536", *nsqd_args)
    proc.log_path = str(tmp_path / "nsqd.log")
    ledger, problems = Ledger(), []
    with PowerFS(disk, mnt):
        proc.start()
        assert proc.stop() == 0
    fs = PowerFS(disk, mnt, dir_sync=dir_sync, unsynced_suffix=unsynced_suffix)
    try:
        fs.mount()
        proc.start()
        for rnd in range(rounds):
            started = time.monotonic()
            await run_until_killed(proc, ledger, rnd, rng)
            fs.cut()
            try:
                proc.start()
            except RuntimeError as e:
                problems.append(f"round {rnd} (seed {seed}): nsqd did not start after the "
                                f"cut: {str(e)[-600:]}")
                break
            acked = len(ledger.published)
            found, checked = await check(proc, ledger)
            print(f"power cut {rnd}: {acked} messages acknowledged, {checked} checked in "
                  f"{len(ledger.channels)} channels of {len(ledger.topics)} topics, "
                  f"{len(found)} problems, {time.monotonic() - started:.1f} s")
            problems += [f"round {rnd} (seed {seed}): {p}" for p in found]
            if found and stop_at_first:
                break
    finally:
        proc.kill()
        fs.unmount()
    return problems


async def test_acknowledged_messages_topics_and_channels_survive_power_cuts(tmp_path):
    problems = await power_cuts(tmp_path, CI_ROUNDS)
    assert not problems, "\n".join(problems)


@pytest.mark.long
async def test_many_power_cuts(tmp_path):
    """LONG_ROUNDS cuts, on a fresh node every CI_ROUNDS (a node's start grows with the
    topics the rounds leave behind)."""
    for run in range(LONG_ROUNDS // CI_ROUNDS):
        problems = await power_cuts(tmp_path / f"run{run}", CI_ROUNDS)
        assert not problems, "\n".join(problems)


async def test_the_checker_catches_acknowledgements_without_sync(tmp_path):
    """Negative run: --sync-every 1000000 acknowledges before syncing, and the checker
    finds acknowledged messages lost."""
    problems = await power_cuts(tmp_path, 5, "--sync-every", "1000000", stop_at_first=True)
    print("\n".join(problems))
    assert any("acknowledged messages lost" in p for p in problems), problems


async def test_the_checker_catches_a_node_journal_that_is_not_synced(tmp_path):
    """Negative run: PowerFS ignores the fsync of the node journal's files (diskqueue/
    journal.py), the one sync of a round: the checker finds acknowledged messages lost."""
    problems = await power_cuts(tmp_path, 5, unsynced_suffix=".jnl", stop_at_first=True)
    print("\n".join(problems))
    assert any("acknowledged messages lost" in p for p in problems), problems


async def test_without_the_journal_nothing_acknowledged_is_lost(tmp_path):
    """--journal false: each batch synced in its own segment by its partition's write thread
    (the default run above syncs a round's durable batches with one fdatasync of the node
    journal, replayed into their segments after the cut)."""
    problems = await power_cuts(tmp_path, CI_ROUNDS, "--journal", "false")
    assert not problems, "\n".join(problems)


async def test_the_checker_catches_folders_that_are_not_synced(tmp_path):
    """Negative run: PowerFS ignores every folder fsync, so the folders of new topics (and
    their channels' delay stores) never reach the disk; the checker finds topics, channels
    or messages lost (or a node that cannot start)."""
    problems = await power_cuts(tmp_path, 5, dir_sync=False, stop_at_first=True)
    print("\n".join(problems))
    assert problems
