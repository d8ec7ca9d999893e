"""What tag dispatch and ext filters cost nsqd: its CPU per message consumed, over the wire.

One real nsqd (bench/nsqd_server.py), one topic, four channels made before publishing, so
each holds the same N messages (100,000; `--quick` 20,000), published with MPUB_EXT in
batches of 500. Every header has `color` (red, blue, green in turn) and `n`; every other
message carries `##client_dispatch_tag: a`. Then each channel is consumed on its own by
raw connections (RDY 200, a FIN per message) until every message is finished, and the
nsqd process's CPU time (user + system, /proc) over that is divided by N:

  none         2 consumers, no tag, no filter (the unrouted path)
  tags         a consumer with desired_tag a, one without: each takes its half
  regexp       1 consumer with ext_filter regexp `^(red|blue)$`: a third is auto-finished
  three        3 untagged consumers, one filter each (exact red, regexp `^bl`, glob `g*`):
               every message is matched against them until one takes it

    .venv/bin/python bench/tags.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the bench modules are imported as bench.*
    sys.path.append(ROOT)
from bench.common import Report, machine_info  # noqa: E402
from bench.nsqd_server import Server, pid_cpu_seconds  # noqa: E402
from nsqwire import commands as c  # noqa: E402
from nsqwire import protocol as p  # noqa: E402

TOPIC = "bench_tags"
COLORS = ("red", "blue", "green")
SCENARIOS = {
    "none": [{}, {}],
    "tags": [{"desired_tag": "a"}, {}],
    "regexp": [{"ext_filter": {"type": 2, "filter_ext_key": "color",
                               "filter_data": "^(red|blue)$"}}],
    "three": [{"ext_filter": {"type": 1, "filter_ext_key": "color", "filter_data": "red"}},
              {"ext_filter": {"type": 2, "filter_ext_key": "color", "filter_data": "^bl"}},
              {"ext_filter": {"type": 3, "filter_ext_key": "color", "filter_data": "g*"}}],
}


def http(server, path: str) -> dict:
    req = urllib.request.Request(f"http://{server.proc.http_address}{path}", method="POST"
                                 if "create" in path else "GET")
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read()
    return json.loads(body) if body.startswith(b"{") else {}


def confirmed(server, channel: str) -> int:
    stats = http(server, f"/stats?format=json&topic={TOPIC}&channel={channel}")
    topic = next(t for t in stats["topics"] if t["topic_name"] == TOPIC)
    ch = next(x for x in topic["channels"] if x["channel_name"] == channel)
    return sum(part["confirmed_count"] for part in ch["partitions"])


async def publish(server, count: int) -> None:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    frames = c.FrameParser()
    writer.write(p.MAGIC_V2)
    sent = 0
    while sent < count:
        batch = []
        for n in range(sent, min(sent + 500, count)):
            header = {"color": COLORS[n % 3], "n": n}
            if n % 2:
                header["##client_dispatch_tag"] = "a"
            batch.append((header, b"x" * 100))
        writer.write(c.cmd_mpub_ext(TOPIC, batch))
        sent += len(batch)
        got = []
        while not got:
            frames.feed(await reader.read(65536))
            got = list(frames.frames())
        assert got == [(p.FRAME_RESPONSE, b"OK")], got
    writer.close()


async def consume(server, channel: str, identify: dict, counter: list, stop: asyncio.Event):
    reader, writer = await asyncio.open_connection(server.host, server.port)
    frames = c.FrameParser()
    writer.write(p.MAGIC_V2 + c.cmd_identify(identify) + c.cmd_sub(TOPIC, channel) + c.cmd_rdy(200))
    read = asyncio.ensure_future(reader.read(1 << 20))
    halt = asyncio.ensure_future(stop.wait())
    while True:
        done, _ = await asyncio.wait({read, halt}, return_when=asyncio.FIRST_COMPLETED)
        if halt in done:
            read.cancel()
            break
        data = read.result()
        if not data:
            break
        frames.feed(data)
        fins = []
        for kind, payload in frames.frames():
            if kind == p.FRAME_MESSAGE:
                fins.append(c.cmd_fin(payload[10:26]))
            elif payload == b"_heartbeat_":
                fins.append(c.cmd_nop())
            elif kind == p.FRAME_ERROR:
                raise RuntimeError(payload)
        counter[0] += len(fins)
        writer.write(b"".join(fins))
        read = asyncio.ensure_future(reader.read(1 << 20))
    writer.close()


async def run_scenario(server, name: str, count: int) -> dict:
    counter, stop = [0], asyncio.Event()
    cpu0, t0 = pid_cpu_seconds(server.pid), time.monotonic()
    tasks = [asyncio.ensure_future(consume(server, name, ident, counter, stop))
             for ident in SCENARIOS[name]]
    while confirmed(server, name) < count:
        await asyncio.sleep(0.05)
    cpu, wall = pid_cpu_seconds(server.pid) - cpu0, time.monotonic() - t0
    stop.set()
    await asyncio.gather(*tasks)
    return {"delivered": counter[0], "filtered": count - counter[0], "cpu_s": cpu, "wall_s": wall}


async def main_async(args) -> None:
    count = 20_000 if args.quick else 100_000
    report = Report("tags")
    report.figures.update(machine_info())
    with Server([], None) as server:
        http(server, f"/topic/create?topic={TOPIC}")
        for name in SCENARIOS:
            http(server, f"/channel/create?topic={TOPIC}&channel={name}")
        report.section(f"publishing {count:,} messages (MPUB_EXT, headers with color and tag)")
        await publish(server, count)
        report.section("nsqd CPU per message consumed, one channel at a time")
        rows = {}
        for name in SCENARIOS:
            rows[name] = r = await run_scenario(server, name, count)
            us = r["cpu_s"] / count * 1e6
            report.add(f"{name}_cpu_us_per_msg", us, f"{name}: nsqd CPU per message (us)")
            report.add(f"{name}_msgs_per_s", count / r["wall_s"], f"{name}: messages per second")
            report.figures[f"{name}_filtered"] = r["filtered"]
        base = rows["none"]["cpu_s"]
        print("\n   scenario   consumers  delivered   filtered   CPU us/msg   vs none")
        for name, r in rows.items():
            print(f"   {name:<10} {len(SCENARIOS[name]):>9} {r['delivered']:>10,} {r['filtered']:>10,}"
                  f" {r['cpu_s'] / count * 1e6:>12.1f} {r['cpu_s'] / base:>9.2f}x", flush=True)
            report.figures[f"{name}_cpu_ratio_to_none"] = round(r["cpu_s"] / base, 3)
    report.emit_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 messages instead of 100,000")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
