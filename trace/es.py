"""The Elasticsearch trace store (`--trace-es-url`), through the official `elasticsearch`
client (9.x, synchronous: EsStore runs in the trace store's process, process.py, and
`search` in the node's searches' threads, never on the event loop).

Events go in bulk requests to daily indices `<prefix>YYYY.MM.DD` (the event's UTC day;
prefix `nsq-trace-` by default), shaped by one index template (`<prefix>template`, put
before the first bulk) with the mapping: ids as keywords (msg_id 16 hex characters as clients see it,
trace_id decimal: both are unsigned 64-bit, past ES's signed `long`), `time` a date
(ms), `time_ns` a long (exact order and windows), names and kinds keywords.

Each document's `_id` is `<node>/<boot ns>/<seq>`, so a bulk request retried after a lost
answer writes nothing twice (by a new store process too: the node gives each the same
`id_base` and the `seq` to go on from). A store that cannot be reached (connection refused, 5xx,
429) raises StoreUnavailable: the writer keeps the batch and retries with backoff. A
document the server refuses (a mapping conflict) is dropped and counted, never retried.

Retention: whole daily indices older than `max_age_s` are deleted (no size bound here:
that is the cluster's ILM's job).
"""

from __future__ import annotations

import datetime
import json
import time

from elasticsearch import ApiError, Elasticsearch, TransportError

from .events import FIELDS, NO_MESSAGE, msg_id_hex
from .store import StoreUnavailable

DEFAULT_PREFIX = "nsq-trace-"

MAPPING = {
    "dynamic": "strict",
    "properties": {
        "time": {"type": "date", "format": "epoch_millis"},
        "time_ns": {"type": "long"},
        "seq": {"type": "long"},
        "node": {"type": "keyword"},
        "kind": {"type": "keyword"},
        "topic": {"type": "keyword"},
        "partition": {"type": "integer"},
        "channel": {"type": "keyword"},
        "msg_id": {"type": "keyword"},
        "trace_id": {"type": "keyword"},
        "offset": {"type": "long"},
        "attempts": {"type": "integer"},
        "detail": {"type": "keyword", "ignore_above": 1024},
    },
}


DAY_NS = 86_400 * 10**9  # a UTC day: POSIX time has no leap seconds
# the bulk body's lines, encoded here: one encoder for all (the client's serializer makes
# one a line, and the encoding was most of this process's CPU)
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _transient(e: Exception) -> bool:
    if isinstance(e, ApiError):
        return e.meta.status >= 500 or e.meta.status == 429
    return isinstance(e, TransportError)  # connection refused, reset, timed out


def _why(e: Exception) -> str:
    """What went wrong, said fully: a transport error's str() is only its kind ("TLS
    error", "Connection error"); its message names the cause."""
    if isinstance(e, TransportError):
        return f"{e}: {e.message}"[:300]
    return str(e)


def client(url: str, *, ca_certs: str | None = None, username: str | None = None,
           password: str | None = None, api_key: str | None = None) -> Elasticsearch:
    """The official client for `url`: https checked against `ca_certs` (else the system's
    CAs), basic auth or an API key when given. It tries once per call: the writer retries
    with its own backoff."""
    options = {}
    if ca_certs:
        options["ca_certs"] = ca_certs
    if username:
        options["basic_auth"] = (username, password or "")
    if api_key:
        options["api_key"] = api_key
    return Elasticsearch(url, request_timeout=10, max_retries=0, retry_on_timeout=False,
                         **options)


def id_base_of(node: str) -> str:
    """The start of a node's document ids, `<node>/<start ns>/`: unique to this run of the
    node, the same in every store process it starts (process.py), so that a batch sent
    again by a new one has the ids it had."""
    return f"{node}/{time.time_ns()}/"


def day_index(prefix: str, time_ns: int) -> str:
    day = datetime.datetime.fromtimestamp(time_ns / 1e9, datetime.timezone.utc)
    return f"{prefix}{day:%Y.%m.%d}"


class EsStore:
    """The store process's side: put the template, bulk-write batches, drop old indices."""

    def __init__(self, url: str, node: str, prefix: str = DEFAULT_PREFIX, *,
                 id_base: str | None = None, seq: int = 0, **client_options):
        self.node = node
        self.prefix = prefix
        self._es = client(url, **client_options)
        self._id_base = id_base or id_base_of(node)
        self._seq = seq  # the last event's number: the next batch's first is seq + 1
        self._template_put = False  # put before the first bulk (and after each outage)

    def _put_template(self) -> None:
        """Put the index template: before the first bulk, and again before the first one
        after the store was unreachable (a cluster rebuilt meanwhile has none)."""
        try:
            self._es.indices.put_index_template(
                name=f"{self.prefix}template", index_patterns=[f"{self.prefix}*"],
                template={"settings": {"number_of_shards": 1}, "mappings": MAPPING})
        except Exception as e:
            if _transient(e):
                raise StoreUnavailable(_why(e)) from e
            raise
        self._template_put = True

    def close(self) -> None:
        self._es.close()

    def write(self, events: list[tuple]) -> int:
        """Bulk-write a batch; return how many documents the server refused (dropped).
        StoreUnavailable: nothing is known written, the same batch may be sent again (the
        ids make a resend idempotent)."""
        if not self._template_put:
            self._put_template()
        lines = []
        seq = self._seq
        day_start = day_end = 0  # the UTC day of `index`, in ns
        for e in events:
            seq += 1
            if not day_start <= e[0] < day_end:  # a batch's events mostly share one day
                day_start = e[0] - e[0] % DAY_NS
                day_end, index = day_start + DAY_NS, day_index(self.prefix, e[0])
            lines.append(_encode({"index": {"_index": index, "_id": f"{self._id_base}{seq}"}}))
            lines.append(_encode(self._doc(e, seq)))
        lines.append("")
        try:
            answer = self._es.bulk(operations="\n".join(lines))
        except Exception as e:
            if _transient(e):
                self._template_put = False
                raise StoreUnavailable(_why(e)) from e
            raise
        refused = [i for i in answer["items"] if i["index"].get("status", 500) >= 300] \
            if answer.get("errors") else []
        if any(i["index"].get("status") in (429, 503) for i in refused):
            raise StoreUnavailable("bulk items refused as overloaded")  # resend all: same ids
        self._seq = seq
        return len(refused)

    def _doc(self, e: tuple, seq: int) -> dict:
        time_ns, kind, topic, partition, channel, msg_id, trace_id, offset, attempts, detail = e
        return {"time": time_ns // 1_000_000, "time_ns": time_ns, "seq": seq,
                "node": self.node, "kind": kind, "topic": topic, "partition": partition,
                "channel": channel, "msg_id": msg_id_hex(msg_id), "trace_id": str(trace_id),
                "offset": offset, "attempts": attempts, "detail": detail}

    def retain(self, max_age_s: float | None, max_bytes: int | None,
               now_ns: int | None = None) -> int:
        """Delete the daily indices wholly older than `max_age_s`; return 0 (documents
        are not counted one by one here)."""
        if not max_age_s:
            return 0
        cutoff = day_index(self.prefix, (now_ns or time.time_ns()) - int(max_age_s * 1e9))
        names = self._es.indices.get(index=f"{self.prefix}*", ignore_unavailable=True,
                                     allow_no_indices=True)
        for name in names:
            day = name[len(self.prefix):]
            if len(day) == 10 and f"{self.prefix}{day}" < cutoff:
                self._es.indices.delete(index=name)
        return 0


def search(es: Elasticsearch, prefix: str, *, msg_id: int | None = None,
           trace_id: int | None = None, topic: str | None = None, channel: str | None = None,
           since_ns: int | None = None, until_ns: int | None = None,
           limit: int = 1000) -> list[dict]:
    """store.search's answer from Elasticsearch: events matching every condition, in time
    order, at most `limit` (the oldest). StoreUnavailable while it cannot be reached."""
    terms = []
    if msg_id is not None:
        terms.append({"term": {"msg_id": msg_id_hex(msg_id)}})
    if trace_id is not None:
        terms.append({"term": {"trace_id": str(trace_id)}})
    if topic is not None:
        terms.append({"term": {"topic": topic}})
    if channel is not None:  # a channel's events, and its topic's
        terms.append({"bool": {"should": [{"term": {"channel": channel}},
                                          {"term": {"channel": ""}}],
                               "minimum_should_match": 1}})
    if since_ns is not None or until_ns is not None:
        window = {}
        if since_ns is not None:
            window["gte"] = since_ns
        if until_ns is not None:
            window["lt"] = until_ns
        terms.append({"range": {"time_ns": window}})
    if not terms:
        raise ValueError("search needs msg_id, trace_id or topic")
    try:
        answer = es.search(index=f"{prefix}*", query={"bool": {"filter": terms}},
                           sort=[{"time_ns": "asc"}, {"seq": "asc"}], size=limit,
                           ignore_unavailable=True, allow_no_indices=True)
    except Exception as e:
        if _transient(e):
            raise StoreUnavailable(_why(e)) from e
        raise
    out = []
    for hit in answer["hits"]["hits"]:
        doc = hit["_source"]
        event = {"node": doc["node"], **{f: doc[f] for f in FIELDS}}
        event["msg_id"] = int(doc["msg_id"], 16) if doc["msg_id"] else NO_MESSAGE
        event["trace_id"] = int(doc["trace_id"])
        out.append(event)
    return out
