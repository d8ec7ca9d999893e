"""Load generators for bench/nsqd.py: processes that drive nsqd over raw TCP.

`Workers` starts one child process per job description (a picklable dict, "spec"):
multiprocessing with spawn, uvloop, and one tight asyncio.Protocol per connection on raw
frames. `ProduceJob` connections send a PUB or an MPUB, wait for OK and send again;
`ConsumeJob` runs one `Group` of consumers per channel, the FINs of one socket read sent in
one write. Every child connects, reports ready, starts at the time the parent gives (so all
start together) and sends back its counts, latencies and the CPU seconds it used.

The children import this module as `bench.loadgen`: the repository root must be on
sys.path before `Workers` starts them (bench/nsqd.py appends it; children inherit sys.path).
"""

from __future__ import annotations

import array
import asyncio
import multiprocessing
import os
import resource
import struct
import time

from nsqwire.commands import (FrameParser, cmd_cls, cmd_mpub_ext, cmd_nop, cmd_pub_ext, cmd_rdy,
                              cmd_sub)
from nsqwire import protocol as p

FRAME = struct.Struct(">ii")
# A named request's sequence as a decimal string of 19 digits (the server reads a string as
# HTTP's): the command is encoded once and only these bytes change.
_SLOT = "X" * 19


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class ProduceJob:
    """Connections that each send `cmd` (a PUB or an MPUB), wait for OK, and send again:
    for a time window (`warm_s` unmeasured, then `dur_s` measured) or `batches` times.
    With `answers` N (default 1), `cmd` holds N requests sent together (pipelined) and the
    next send waits for all N OKs (`per_cmd` counts the messages of all N).
    With `named` (topic, bodies), each send is an idempotent producer's request instead:
    PUB_EXT (MPUB_EXT for several bodies) named by the connection's producer id and its next
    sequence (nsqd/producers.py), encoded once with the sequence's digits patched.
    With `cmds` (a list), connection i sends cmds[i % len(cmds)] instead (many topics);
    with more commands than connections, connection i sends cmds[i], cmds[i + conns], ...
    in turn, one a send (every topic or partition in use);
    with `targets` (a list of (host, port, cmd), one per connection), connection i goes to
    its own node with its own command (a cluster's leaders)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.cmd: bytes = spec["cmd"]
        self.per_cmd: int = spec["per_cmd"]
        self.timed = spec.get("dur_s") is not None
        self.count = 0
        self.lat = array.array("d")
        self.errors: list[str] = []
        self.m_start = self.m_end = 0.0
        self.t_last = 0.0
        self.conns: list[Producer] = []
        self.open = 0
        self.done: asyncio.Future | None = None

    async def connect(self, loop) -> None:
        self.done = loop.create_future()
        batches = self.spec.get("batches") or [0] * self.spec["conns"]
        targets = self.spec.get("targets")
        for i in range(self.spec["conns"]):
            host, port = (targets[i][0], targets[i][1]) if targets else \
                (self.spec["host"], self.spec["port"])
            _, proto = await loop.create_connection(lambda: Producer(self), host, port)
            proto.left = batches[i]
            if targets:
                proto.cmd = targets[i][2]
            elif self.spec.get("cmds"):
                cmds = self.spec["cmds"]
                proto.cmd = cmds[i % len(cmds)]
                if len(cmds) > self.spec["conns"]:
                    proto.turns = cmds[i::self.spec["conns"]]
            if self.spec.get("named"):
                proto.named = (*self.spec["named"], f"bench-{os.getpid()}-{i}")
            self.conns.append(proto)

    async def run(self, t0: float) -> dict:
        self.m_start = t0 + self.spec.get("warm_s", 0.0)
        self.m_end = self.m_start + (self.spec.get("dur_s") or 0.0)
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        for c in self.conns:
            if self.timed or c.left > 0:
                self.open += 1
                c.send()
        if self.open:
            await self.done
        for c in self.conns:
            c.transport.close()
        return {"count": self.count, "lat": self.lat.tobytes(), "t_last": self.t_last,
                "errors": self.errors[:5], "n_errors": len(self.errors)}

    def finished(self, conn) -> None:
        if conn.finished:
            return
        conn.finished = True
        self.open -= 1
        if self.open == 0 and not self.done.done():
            self.done.set_result(None)


class Producer(asyncio.Protocol):
    def __init__(self, job: ProduceJob):
        self.job = job
        self.frames = FrameParser()
        self.transport = None
        self.cmd = job.cmd
        self.t_sent = 0.0
        self.left = 0
        self.finished = False
        self.answers = job.spec.get("answers", 1)  # OKs that answer one send
        self.pending = 0
        self.named: tuple | None = None  # (topic, bodies, producer id): see ProduceJob
        self.template: bytes | None = None
        self.slot = 0
        self.sequence = 0
        self.turns: list[bytes] = []  # commands taken in turn, one a send (see ProduceJob)
        self.turn = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(p.MAGIC_V2)

    def send(self, now: float | None = None) -> None:
        self.t_sent = time.monotonic() if now is None else now
        self.pending = self.answers
        if self.turns:
            self.turn = (self.turn + 1) % len(self.turns)
            self.cmd = self.turns[self.turn]
        if self.named is None:
            self.transport.write(self.cmd)
            return
        if self.template is None:  # the command once, its sequence a slot of 19 digits
            topic, bodies, producer_id = self.named
            header = {"##producer_id": producer_id, "##sequence": _SLOT}
            if len(bodies) == 1:
                self.template = cmd_pub_ext(topic, header, bodies[0])
            else:
                self.template = cmd_mpub_ext(topic, [(header, bodies[0])]
                                             + [({}, b) for b in bodies[1:]])
            self.slot = self.template.index(_SLOT.encode())
        at = self.slot
        self.transport.write(self.template[:at] + b"%019d" % self.sequence
                             + self.template[at + 19:])
        self.sequence += 1

    def data_received(self, data: bytes) -> None:
        f = self.frames
        f.feed(data)
        for kind, payload in f.frames():
            if kind == p.FRAME_RESPONSE:
                if payload == b"OK":
                    self.pending -= 1
                    if not self.pending:
                        self._ok()
                elif payload == b"_heartbeat_":
                    self.transport.write(cmd_nop())
            else:
                self.job.errors.append(payload[:200].decode(errors="replace"))
                self.job.finished(self)

    def _ok(self) -> None:
        now = time.monotonic()
        job = self.job
        if job.timed:
            if self.t_sent >= job.m_start and now <= job.m_end:
                job.count += job.per_cmd
                job.lat.append(now - self.t_sent)
            if now < job.m_end:
                self.send(now)
            else:
                job.finished(self)
        else:
            job.count += job.per_cmd
            job.lat.append(now - self.t_sent)
            job.t_last = now
            self.left -= 1
            if self.left > 0:
                self.send(now)
            else:
                job.finished(self)

    def connection_lost(self, exc) -> None:
        if not self.finished:
            self.job.errors.append(f"connection lost: {exc}")
            self.job.finished(self)


class Group:
    """The consumers of one channel (all in this process): done when `expected` messages
    are received (then CLS; CLOSE_WAIT confirms every earlier FIN was processed), or at
    the deadline (what was received until then counts)."""

    def __init__(self, topic: str, channel: str, expected: int):
        self.topic = topic
        self.channel = channel
        self.expected = expected
        self.received = 0
        self.counted = 0
        self.redelivered = 0
        self.reads = 0  # socket reads that brought messages
        self.consumers: list[Consumer] = []
        self.closing = False
        self.drained = False
        self.closed = 0
        self.t_end = 0.0
        self.fut: asyncio.Future | None = None

    def close(self, drained: bool) -> None:
        if self.closing:
            return
        self.closing = True
        self.drained = drained
        if not drained:  # deadline: count until now
            self.counted = self.received
            self.t_end = time.monotonic()
        for c in self.consumers:
            if not c.transport.is_closing():
                c.transport.write(cmd_cls())

    def consumer_closed(self) -> None:
        self.closed += 1
        if self.closed == len(self.consumers) and not self.fut.done():
            if self.drained:
                self.counted = self.received
                self.t_end = time.monotonic()
            self.fut.set_result(None)


class Consumer(asyncio.Protocol):
    def __init__(self, group: Group, rdy: int, errors: list):
        self.group = group
        self.rdy = rdy
        self.errors = errors
        self.transport = None
        self.buf = bytearray()
        self.subscribed = False
        self.done = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(p.MAGIC_V2)

    def start(self) -> None:
        self.transport.write(cmd_sub(self.group.topic, self.group.channel))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        n = len(buf)
        pos = 0
        ids = []
        unpack = FRAME.unpack_from
        while n - pos >= 8:
            size, kind = unpack(buf, pos)
            end = pos + 4 + size
            if end > n:
                break
            if kind == p.FRAME_MESSAGE:
                # size, type, timestamp (8), attempts (2), id (16), body
                ids.append(buf[pos + 18:pos + 34])
                if buf[pos + 17] != 1 or buf[pos + 16]:
                    self.group.redelivered += 1
            else:
                self._other(kind, bytes(buf[pos + 8:end]))
            pos = end
        if pos:
            del buf[:pos]
        if ids:
            self.transport.write(b"FIN " + b"\nFIN ".join(ids) + b"\n")
            g = self.group
            g.received += len(ids)
            g.reads += 1
            if g.received >= g.expected:
                g.close(drained=True)

    def _other(self, kind: int, payload: bytes) -> None:
        if kind == p.FRAME_RESPONSE:
            if payload == b"OK" and not self.subscribed:
                self.subscribed = True
                self.transport.write(cmd_rdy(self.rdy))
            elif payload == b"_heartbeat_":
                self.transport.write(cmd_nop())
            elif payload == b"CLOSE_WAIT":
                self._closed()
        else:
            self.errors.append(payload[:200].decode(errors="replace"))
            if not payload.startswith((b"E_FIN_FAILED", b"E_REQ_FAILED", b"E_TOUCH_FAILED")):
                self._closed()

    def _closed(self) -> None:
        if not self.done:
            self.done = True
            if not self.group.closing:
                self.group.close(drained=False)
            self.group.consumer_closed()

    def connection_lost(self, exc) -> None:
        if not self.done:
            self.errors.append(f"connection lost: {exc}")
            self._closed()


class ConsumeJob:
    """Groups of consumers, one group per channel of spec["topic"] (spec["groups"]:
    [(channel, consumers)])."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.groups = [Group(spec["topic"], ch, spec["expected"]) for ch, _ in spec["groups"]]
        self.errors: list[str] = []

    async def connect(self, loop) -> None:
        for group, (_, k) in zip(self.groups, self.spec["groups"]):
            group.fut = loop.create_future()
            for _ in range(k):
                _, proto = await loop.create_connection(
                    lambda: Consumer(group, self.spec["rdy"], self.errors), self.spec["host"],
                    self.spec["port"])
                group.consumers.append(proto)

    async def run(self, t0: float) -> dict:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        for g in self.groups:
            for c in g.consumers:
                c.start()
        max_s = self.spec.get("max_s")
        if max_s:
            def deadline():
                for g in self.groups:
                    g.close(drained=False)
            loop.call_at(loop.time() + max(0.0, t0 + max_s - time.monotonic()), deadline)
        await asyncio.gather(*(g.fut for g in self.groups))
        for g in self.groups:
            for c in g.consumers:
                c.transport.close()
        return {"groups": [{"channel": g.channel, "counted": g.counted, "received": g.received,
                            "t_end": g.t_end, "drained": g.drained,
                            "redelivered": g.redelivered, "reads": g.reads}
                           for g in self.groups],
                "count": sum(g.counted for g in self.groups),
                "errors": self.errors[:5], "n_errors": len(self.errors)}


async def _worker(spec: dict, pipe) -> None:
    loop = asyncio.get_running_loop()
    job = ProduceJob(spec) if spec["kind"] == "produce" else ConsumeJob(spec)
    await job.connect(loop)
    pipe.send(("ready", None))
    msg = await loop.run_in_executor(None, pipe.recv)
    if msg[0] != "go":
        return
    cpu0 = cpu_seconds()
    result = await asyncio.wait_for(job.run(msg[1]), spec["timeout_s"])
    result["cpu_s"] = cpu_seconds() - cpu0
    pipe.send(("result", result))


def worker_main(spec: dict, pipe) -> None:
    import uvloop

    try:
        uvloop.run(_worker(spec, pipe))
    except BaseException as e:  # report, never hang the parent
        try:
            pipe.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass


class Workers:
    """Load-generator processes: start, wait until connected, go, collect results."""

    def __init__(self, specs: list[dict]):
        ctx = multiprocessing.get_context("spawn")
        self.procs = []
        self.pipes = []
        for spec in specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, child), daemon=True)
            self.procs.append(proc)
            self.pipes.append(parent)
        self.timeout_s = max(s["timeout_s"] for s in specs) + 30

    def start(self) -> None:
        for proc in self.procs:
            proc.start()
        for pipe in self.pipes:
            kind, value = self._recv(pipe, 60)
            if kind != "ready":
                raise RuntimeError(f"load generator failed to start: {value}")

    def go(self, t0: float) -> None:
        for pipe in self.pipes:
            pipe.send(("go", t0))

    def results(self) -> list[dict]:
        out = []
        for pipe in self.pipes:
            kind, value = self._recv(pipe, self.timeout_s)
            if kind != "result":
                raise RuntimeError(f"load generator failed: {value}")
            out.append(value)
        return out

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("stop", None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)

    @staticmethod
    def _recv(pipe, timeout: float):
        if not pipe.poll(timeout):
            return "error", f"no answer in {timeout:.0f} s"
        try:
            return pipe.recv()
        except EOFError:
            return "error", "load generator exited"

