"""A channel's dead letters over HTTP (nsqd/deadletters.py), for its partitions led here.
Added to http.py's ROUTES at start; every answer is JSON.

- `POST /channel/config?topic=&channel=[&partition=]&max_attempts=N`: bury a message once
  it was delivered N times (0..65535; 0: never). Saved with the channel's checkpoint and,
  on a replicated partition, held by every ISR follower before the answer.
  -> {"max_attempts": N}
- `GET /channel/dead?topic=&channel=[&partition=][&after=ID][&limit=N]`: the dead letters
  in log order, partition by partition, from the one after dead letter `after` (its `id`),
  at most `limit` (default 100, at most 1,000): {"dead_letters": [...], "count": how many
  in all, "loading": [partitions whose dead letters are still being read back]}.
  Each: `id` (the dead copy's), `partition`, `message_id`, `attempts`, `cause` (req,
  timeout, closed, spent), `error` (the client's last REQ reason, or null),
  `published_ns`, `buried_ns`, `body_size`, and the body's first BODY_PREVIEW bytes as
  `body` (UTF-8) or `body_base64`.
- `GET /channel/dead/message?topic=&channel=&id=`: one, with its whole body and its
  client header (`ext`, as an extend_support client receives it, or null).
- `POST /channel/dead/requeue?topic=&channel=[&partition=][&id=]`: one (or, without
  `id`, every one) delivered again to the channel as a fresh message -> {"count": n}.
- `POST /channel/dead/purge?topic=&channel=[&partition=][&id=]`: one (or every one)
  dropped -> {"count": n}.

Errors: 400 INVALID_ARG_MAX_ATTEMPTS, INVALID_ARG_LIMIT, INVALID_ID, EPHEMERAL_CHANNEL,
BAD_PARTITION; 404 TOPIC_NOT_FOUND, CHANNEL_NOT_FOUND, DEAD_LETTER_NOT_FOUND; 503
DEAD_LETTERS_LOADING (read back from the log after a restart or failover: ask again),
NOT_WRITABLE (the partition did not commit the change: nothing, or part, was done).
"""

from __future__ import annotations

import base64
import json

import structlog
from nsqtrace.events import parse_msg_id

from nsqwire import ext as wire_ext
from nsqwire.ext import dead_control
from nsqwire.ids import PARTITION_SHIFT, encode_msg_id

from .deadletters import DeadLettersLoading
from .http import HTTPError, _existing_channels, _persist_channels, _topic_channel
from .httpargs import arg, query

log = structlog.get_logger("nsqd.deadhttp")

MAX_ATTEMPTS = 0xFFFF  # a record's attempts field is 16 bits
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
BODY_PREVIEW = 1024  # bytes of each body a listing shows


def _int_arg(params, name: str, code: str, low: int, high: int, default: int | None = None):
    raw = arg(params, name)
    if raw is None and default is not None:
        return default
    if raw is None or not raw.isdigit() or not low <= int(raw) <= high:
        raise HTTPError(400, code)
    return int(raw)


def _id_arg(params, name: str = "id") -> int | None:
    raw = arg(params, name)
    if raw is None:
        return None
    try:
        return parse_msg_id(raw)
    except ValueError:
        raise HTTPError(400, "INVALID_ID") from None


async def _channels(nsqd, request, msg_id: int | None = None):
    """(params, the channels named, by partition); with `msg_id`, its partition's only."""
    params, topic, name = await _topic_channel(nsqd, request)
    channels = sorted(_existing_channels(topic, params, name), key=lambda c: c.partition)
    if msg_id is not None:
        channels = [c for c in channels if c.partition == msg_id >> PARTITION_SHIFT]
        if not channels:
            raise HTTPError(404, "DEAD_LETTER_NOT_FOUND")
    return params, channels


async def _ready(channel) -> None:
    try:
        await channel.dead.ready()
    except DeadLettersLoading:
        raise HTTPError(503, "DEAD_LETTERS_LOADING") from None


def _body_fields(body: bytes, limit: int | None) -> dict:
    shown = body if limit is None else body[:limit]
    try:
        return {"body_size": len(body), "body": shown.decode("utf-8")}
    except UnicodeDecodeError:
        return {"body_size": len(body), "body_base64": base64.b64encode(shown).decode()}


def dead_letter(rec, partition: int, preview: int | None = BODY_PREVIEW) -> dict:
    """A dead copy's record as the API shows it."""
    control = dead_control(rec.ext) or {}
    out = {"id": encode_msg_id(rec.msg_id).decode(), "partition": partition,
           "message_id": control.get("id"), "attempts": control.get("attempts"),
           "cause": control.get("cause"), "error": control.get("error"),
           "published_ns": control.get("published"), "buried_ns": rec.timestamp,
           **_body_fields(rec.body, preview)}
    if preview is None:
        header = wire_ext.delivered(rec.ext, rec.trace_id)
        out["ext"] = json.loads(header) if header else None
    return out


async def do_channel_config(nsqd, request):
    params, topic, name = await _topic_channel(nsqd, request)
    if name.endswith("#ephemeral"):
        raise HTTPError(400, "EPHEMERAL_CHANNEL")
    n = _int_arg(params, "max_attempts", "INVALID_ARG_MAX_ATTEMPTS", 0, MAX_ATTEMPTS)
    channels = _existing_channels(topic, params, name)
    for c in channels:
        c.set_max_attempts(n)
    await _persist_channels(nsqd, channels)
    return {"max_attempts": n}


async def do_dead_list(nsqd, request):
    params, topic, name = await _topic_channel(nsqd, request)
    after = _id_arg(params, "after")
    limit = _int_arg(params, "limit", "INVALID_ARG_LIMIT", 1, MAX_LIMIT, DEFAULT_LIMIT)
    channels = sorted(_existing_channels(topic, params, name), key=lambda c: c.partition)
    out, loading, count = [], [], 0
    for c in channels:
        dead = c.dead
        if dead is None:
            continue
        if dead.loading:
            loading.append(c.partition)
        count += len(dead.index)
        if len(out) >= limit or dead.loading:
            continue
        start = -1
        if after is not None:
            if c.partition < after >> PARTITION_SHIFT:
                continue
            if c.partition == after >> PARTITION_SHIFT:
                entry = await c.queue.find("msg_id", after)
                start = entry.offset if entry is not None else -1
        for rec in await dead.page(start, limit - len(out)):
            out.append(dead_letter(rec, c.partition))
    return {"dead_letters": out, "count": count, "loading": loading}


async def _one(nsqd, request):
    """(the channel, the dead copy's offset) named by `id`, or 404."""
    msg_id = _id_arg(query(request))
    if msg_id is None:
        raise HTTPError(400, "INVALID_ID")
    _, channels = await _channels(nsqd, request, msg_id)
    channel = channels[0]
    if channel.dead is None:
        raise HTTPError(404, "DEAD_LETTER_NOT_FOUND")
    await _ready(channel)
    offset = await channel.dead.find(msg_id)
    if offset is None:
        raise HTTPError(404, "DEAD_LETTER_NOT_FOUND")
    return channel, offset


async def do_dead_message(nsqd, request):
    channel, offset = await _one(nsqd, request)
    rec = await channel.dead.record(offset)
    if rec is None:
        raise HTTPError(404, "DEAD_LETTER_NOT_FOUND")
    return dead_letter(rec, channel.partition, preview=None)


async def _change(nsqd, request, change) -> dict:
    """requeue or purge: of `id`, or of every dead letter of the channels named."""
    if _id_arg(query(request)) is not None:
        channel, offset = await _one(nsqd, request)
        targets = [(channel, [offset])]
    else:
        _, channels = await _channels(nsqd, request)
        targets = []
        for c in channels:
            if c.dead is not None:
                await _ready(c)
                targets.append((c, None))
    count = 0
    try:
        for channel, offsets in targets:
            count += await change(channel.dead, offsets)
    except Exception as e:  # not committed, or refused at once: not led, closed, disk full
        log.warning("dead_letters_unchanged", topic=channel.topic_name,
                    partition=channel.partition, channel=channel.name, error=str(e),
                    done=count)
        raise HTTPError(503, "NOT_WRITABLE") from None
    return {"count": count}


async def do_dead_requeue(nsqd, request):
    return await _change(nsqd, request, lambda dead, offsets: dead.requeue(
        list(dead.index.offsets) if offsets is None else offsets))


async def do_dead_purge(nsqd, request):
    return await _change(nsqd, request, lambda dead, offsets: dead.purge(offsets))


ROUTES = {
    "/channel/config": {"POST": do_channel_config},
    "/channel/dead": {"GET": do_dead_list},
    "/channel/dead/message": {"GET": do_dead_message},
    "/channel/dead/requeue": {"POST": do_dead_requeue},
    "/channel/dead/purge": {"POST": do_dead_purge},
}
