"""POST /channel/setoffset in cluster mode: the master moves a channel on every partition.

    POST /channel/setoffset?topic=&channel=[&partition=]   body: timestamp:<unix s> |
         offset:<n> | count:<n> | end (and Youzan's virtual_queue:, msgcount:, special:-1)

The master nsqlookupd asks each partition's leader (its nsqd's own /channel/setoffset, in
parallel, `TIMEOUT_S` each, with the admin key when one is set) and answers `{"partitions": [{partition, offset, count,
clipped}, ...]}` when every one moved. When one failed (no live leader, a refusal, a
timeout) the answer is 502 `{"message": "SETOFFSET_FAILED", "failed": [{partition, node,
status, error}], "partitions": [the ones that moved]}`: the moves that succeeded stay (a
retry moves every partition again, the same way). `offset:` and `count:` are places
in one partition's history: without `partition=` on a topic of more partitions they are
400 MISSING_ARG_PARTITION. Errors before any move: 400 INVALID_OFFSET, BAD_PARTITION;
404 TOPIC_NOT_FOUND, CHANNEL_NOT_FOUND (the channel must be in etcd); 503 NOT_MASTER with
the master's address.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import structlog

from nsqwire import adminkey
from nsqwire.protocol import parse_consume_start

from .http import HTTPError, _topic_channel

log = structlog.get_logger("nsqlookupd.setoffset")

TIMEOUT_S = 5.0
MAX_TARGET_BYTES = 64


async def do_channel_setoffset(lookupd, params, body: bytes):
    topic, channel = _topic_channel(params)
    view = await lookupd.cluster.master_view()
    t = view.topics.get(topic)
    if t is None:
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    if channel not in t.channels:
        raise HTTPError(404, "CHANNEL_NOT_FOUND")
    target = body.decode("utf-8", "replace").strip()
    try:
        kind, _ = parse_consume_start(target)
    except ValueError:
        raise HTTPError(400, "INVALID_OFFSET") from None
    numbers = sorted(t.partitions)
    raw = params.get("partition", [None])[0]
    if raw is not None:
        if not raw.isdigit() or int(raw) not in t.partitions:
            raise HTTPError(400, "BAD_PARTITION")
        numbers = [int(raw)]
    if kind in ("offset", "count") and len(numbers) > 1:
        raise HTTPError(400, "MISSING_ARG_PARTITION")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
                                     headers=adminkey.headers(lookupd.admin_secret)) as session:
        results = await asyncio.gather(*(
            _move(session, view, topic, channel, n, target) for n in numbers))
    moved = [r for ok, r in results if ok]
    failed = [r for ok, r in results if not ok]
    log.info("channel_set_offset", topic=topic, channel=channel, target=target,
             moved=len(moved), failed=failed)
    if failed:
        raise HTTPError(502, "SETOFFSET_FAILED", failed=failed, partitions=moved)
    return {"partitions": moved}


do_channel_setoffset.takes_body = MAX_TARGET_BYTES  # dispatch reads this much of the body


async def _move(session, view, topic: str, channel: str, n: int,
                target: str) -> tuple[bool, dict]:
    """(True, the leader's answer entry) or (False, why the partition did not move)."""
    leader = view.topics[topic].partitions[n].leader
    node = view.nodes.get(leader)
    if node is None:
        return False, {"partition": n, "node": leader, "status": 0, "error": "no live leader"}
    url = f"http://{node.http}/channel/setoffset"
    query = {"topic": topic, "channel": channel, "partition": str(n)}
    try:
        async with session.post(url, params=query, data=target.encode()) as r:
            status, data = r.status, await r.read()
        answer = json.loads(data) if data else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        return False, {"partition": n, "node": leader, "status": 0,
                       "error": f"{type(e).__name__}: {e}"[:200]}
    if status == 200 and len(answer.get("partitions", ())) == 1:
        return True, answer["partitions"][0]
    error = answer.get("message", "") if isinstance(answer, dict) else ""
    return False, {"partition": n, "node": leader, "status": status, "error": error}
