"""The HTTP API in cluster mode: classic routes and envelopes, answered from the cluster.

    GET  /lookup?topic=[&access=r|w]   {"channels", "producers", "partitions", "meta"};
                                       400 MISSING_ARG_TOPIC, INVALID_ARG_ACCESS;
                                       404 TOPIC_NOT_FOUND; 503 CLUSTER_VIEW_NOT_READY
    GET  /topics, /channels?topic=     as classic, from the view
    GET  /nodes                        live nodes: classic fields + "partitions" led
    GET  /listlookup                   {"lookupdnodes": [...], "lookupdleader": {...}|null}
    GET  /info                         {"version", "cluster": Cluster.status()}
    POST /topic/create?topic=&partition_num=&replicator=&syncdisk=&retention=&orderedmulti=&ext=
         (aliases: partitions, replicas, sync_every, ordered); 200 (also when the topic
         exists with the same settings), 400 INVALID_ARG_*, 409 TOPIC_EXISTS
    POST /topic/delete?topic=, /channel/create?topic=&channel=, /channel/delete?...
    POST /channel/setoffset?topic=&channel=[&partition=]   fanned out to every partition's
         leader (setoffset.py); 502 SETOFFSET_FAILED naming the partitions that failed

    GET  /cluster/stats?topn=N        load factors per node, heaviest topics (loads.py)
    POST /partition/move_leader?topic=&partition=&to=<node id>   leader transfer within the
         ISR (moves.py); 409 NODE_NOT_LIVE, NOT_IN_ISR, ALREADY_LEADER, MOVE_IN_PROGRESS, ...
    POST /partition/move_replica?topic=&partition=&from=&to=   replica move (moves.py)
    POST /node/drain?node=[&cancel=true]   move everything off a node (balancer.py)
    POST /cluster/balance              one balancer move now; 409 OUTSIDE_BALANCE_WINDOW

Writes on a non-master: 503 {"message": "NOT_MASTER", "master_http_address": "h:p"|null};
etcd unreachable: 503 CLUSTER_METADATA_UNAVAILABLE with "error". A 400 carries "detail".
`/topic/tombstone` has no meaning here (a node leaves by its lease): 404 as unknown.
"""

from __future__ import annotations

import argparse
import re

from isr.state import MAX_PARTITIONS, MAX_REPLICAS, TopicMeta, default_min_isr
from nsqwire.protocol import valid_topic_name

from . import http, setoffset
from .http import HTTPError, _arg, _topic_channel
from .options import parse_duration_s

_DAY_MS = 86_400_000


def _values(params: dict, *names: str) -> str | None:
    """The first value given under any of `names` (a name and its aliases)."""
    for name in names:
        if params.get(name):
            return params[name][0]
    return None


def _int_arg(params: dict, names: tuple[str, ...], code: str, lo: int, hi: int,
             default: int) -> int:
    text = _values(params, *names)
    if text is None:
        return default
    if not re.fullmatch(r"[0-9]{1,9}", text) or not lo <= int(text) <= hi:
        raise HTTPError(400, code, detail=f"{names[0]} {text[:40]!r} not in {lo}..{hi}")
    return int(text)


def _bool_arg(params: dict, names: tuple[str, ...], code: str) -> bool:
    text = _values(params, *names)
    if text is None:
        return False
    if text.lower() not in ("true", "false", "1", "0"):
        raise HTTPError(400, code, detail=f"{names[0]} {text[:40]!r} is not true or false")
    return text.lower() in ("true", "1")


def _retention_ms(params: dict) -> int:
    """`retention`: whole days (Youzan's meaning) or a Go duration (`36h`); 0 = the nodes'."""
    text = _values(params, "retention")
    if text is None:
        return 0
    if re.fullmatch(r"[0-9]{1,5}", text):
        return int(text) * _DAY_MS
    try:
        return int(parse_duration_s(text) * 1000)
    except argparse.ArgumentTypeError:
        raise HTTPError(400, "INVALID_ARG_RETENTION",
                        detail=f"retention {text[:40]!r}: days, or a duration such as 36h")


def _topic(params: dict) -> str:
    topic = _arg(params, "topic", "MISSING_ARG_TOPIC")
    if not valid_topic_name(topic):
        raise HTTPError(400, "INVALID_ARG_TOPIC", detail="1-64 of [.a-zA-Z0-9_-], "
                                                         "optional #ephemeral")
    return topic


# ---- handlers ---------------------------------------------------------------------------


def do_lookup(lookupd, params):
    topic = _arg(params, "topic", "MISSING_ARG_TOPIC")
    access = _values(params, "access") or "r"
    if access not in ("r", "w"):
        raise HTTPError(400, "INVALID_ARG_ACCESS", detail="access is r or w")
    d = lookupd.cluster.directory
    if not d.ready:
        raise HTTPError(503, "CLUSTER_VIEW_NOT_READY", error="etcd not read yet")
    if not d.has_topic(topic):
        raise HTTPError(404, "TOPIC_NOT_FOUND")
    return d.lookup_bytes(topic, access)


def do_info(lookupd, params):
    return {"version": lookupd.version, "cluster": lookupd.cluster.status()}


def do_nodes(lookupd, params):
    return {"producers": lookupd.cluster.directory.nodes()}


def do_listlookup(lookupd, params):
    return lookupd.cluster.listlookup()


async def do_topic_create(lookupd, params):
    topic = _topic(params)
    options = lookupd.options
    replicas = _int_arg(params, ("replicator", "replicas"), "INVALID_ARG_REPLICATOR",
                        1, MAX_REPLICAS, options.default_replicas)
    meta = TopicMeta(
        partitions=_int_arg(params, ("partition_num", "partitions"), "INVALID_ARG_PARTITION_NUM",
                            1, MAX_PARTITIONS, options.default_partitions),
        replicas=replicas,
        min_isr=_int_arg(params, ("min_isr",), "INVALID_ARG_MIN_ISR", 1, replicas,
                         default_min_isr(replicas)),
        sync_every=_int_arg(params, ("syncdisk", "sync_every"), "INVALID_ARG_SYNCDISK",
                            1, 1_000_000_000, 1),
        retention_ms=_retention_ms(params),
        ordered=_bool_arg(params, ("orderedmulti", "ordered"), "INVALID_ARG_ORDERED"),
        ext=_bool_arg(params, ("ext",), "INVALID_ARG_EXT"))
    await lookupd.cluster.create_topic(topic, meta)


async def do_topic_delete(lookupd, params):
    await lookupd.cluster.delete_topic(_topic(params))


async def do_channel_create(lookupd, params):
    topic, channel = _topic_channel(params)
    await lookupd.cluster.create_channel(topic, channel)


async def do_channel_delete(lookupd, params):
    topic, channel = _topic_channel(params)
    if not await lookupd.cluster.delete_channel(topic, channel):
        raise HTTPError(404, "CHANNEL_NOT_FOUND")


def do_cluster_stats(lookupd, params):
    topn = _int_arg(params, ("topn",), "INVALID_ARG_TOPN", 0, 10_000, 10)
    return lookupd.cluster.stats(topn)


def _topic_partition(params) -> tuple[str, int]:
    """A move's topic and partition, both required."""
    topic = _topic(params)
    partition = _int_arg(params, ("partition",), "INVALID_ARG_PARTITION", 0,
                         MAX_PARTITIONS - 1, -1)
    if partition < 0:
        raise HTTPError(400, "MISSING_ARG_PARTITION")
    return topic, partition


async def do_move_leader(lookupd, params):
    topic, partition = _topic_partition(params)
    to = _arg(params, "to", "MISSING_ARG_TO")
    return await lookupd.cluster.mover.move(topic, partition, to)


async def do_move_replica(lookupd, params):
    topic, partition = _topic_partition(params)
    frm = _arg(params, "from", "MISSING_ARG_FROM")
    to = _arg(params, "to", "MISSING_ARG_TO")
    return await lookupd.cluster.mover.move_replica(topic, partition, frm, to)


async def do_node_drain(lookupd, params):
    node = _arg(params, "node", "MISSING_ARG_NODE")
    cancel = _bool_arg(params, ("cancel",), "INVALID_ARG_CANCEL")
    return await lookupd.cluster.balancer.drain(node, cancel)


async def do_cluster_balance(lookupd, params):
    moved = await lookupd.cluster.balancer.step()
    return {"moved": moved}


ROUTES = {
    "/ping": {"GET": None},
    "/info": {"GET": do_info},
    "/lookup": {"GET": do_lookup},
    "/topics": {"GET": http.do_topics},
    "/channels": {"GET": http.do_channels},
    "/nodes": {"GET": do_nodes},
    "/listlookup": {"GET": do_listlookup},
    "/topic/create": {"POST": do_topic_create},
    "/topic/delete": {"POST": do_topic_delete},
    "/channel/create": {"POST": do_channel_create},
    "/channel/delete": {"POST": do_channel_delete},
    "/channel/setoffset": {"POST": setoffset.do_channel_setoffset},
    "/cluster/stats": {"GET": do_cluster_stats},
    "/partition/move_leader": {"POST": do_move_leader},
    "/partition/move_replica": {"POST": do_move_replica},
    "/node/drain": {"POST": do_node_drain},
    "/cluster/balance": {"POST": do_cluster_balance},
}
