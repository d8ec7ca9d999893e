"""The `nsq` PySpark data source: a topic's history by time window, as a DataFrame or a stream.

    from spark.source import register
    register(spark)
    df = (spark.read.format("nsq").option("lookupd", "h:4161").option("topic", "payments")
          .option("since", "2026-11-20T00:00:00Z").option("until", "2026-11-21T00:00:00Z")
          .load())

Planning runs on the driver (client.plan: one /topic/offsets per partition, a commitlog
search on the node); executors read their split over HTTP (client.read_split) and never
touch a node's files. `where timestamp >= ... and timestamp < ...` and `partition = / in`
are pushed down (exactly: a record's timestamp is its write request's, and the commitlog's
timestamp search finds the first request at or after a time), so such a query reads only
that range. Needs `spark.sql.python.filterPushdown.enabled=true` (register sets it).

The stream reader's offsets are `{"<partition>": <virtual offset>}`: a micro-batch reads
[start, end) of each partition, ends taken from the committed ends, so a restarted query
re-reads exactly what its checkpoint says and a file sink gets every message once.
"""

from __future__ import annotations

import sys

from pyspark.sql.datasource import (DataSource, DataSourceReader, DataSourceStreamReader,
                                    EqualTo, GreaterThan, GreaterThanOrEqual, In, InputPartition,
                                    LessThan, LessThanOrEqual)

from . import client
from .client import NsqSourceError, Options, Split

_US = 1000  # ns per microsecond: Spark's timestamps are microseconds


class NsqPartition(InputPartition):
    """A Split as Spark's InputPartition (pickled to the executor)."""

    def __init__(self, split: Split | None):
        super().__init__(split)
        self.split = split


class NsqDataSource(DataSource):
    """`format("nsq")`: options in client.Options (topic, lookupd | nsqd, since, until,
    partitions, max_partition_bytes, timeout, retry_timeout, before_retention)."""

    @classmethod
    def name(cls) -> str:
        return "nsq"

    def schema(self) -> str:
        o = Options.parse(self.options)  # bad options fail here, at load(), before any job
        if o.lookupd:
            client.lookup(o)  # an unknown topic or no nsqlookupd: at load() too
        else:
            client.windows(Options(**{**o.__dict__, "retry_s": 0.0}))
        return client.SCHEMA

    def reader(self, schema) -> "NsqReader":
        return NsqReader(Options.parse(self.options))

    def streamReader(self, schema) -> "NsqStreamReader":
        return NsqStreamReader(Options.parse(self.options))


class NsqReader(DataSourceReader):
    def __init__(self, options: Options):
        self.o = options
        self.notes: list[str] = []

    def pushFilters(self, filters):
        """Take the timestamp bounds and partition choices; give back the rest."""
        for f in filters:
            if not self._take(f):
                yield f

    def _take(self, f) -> bool:
        column = getattr(f, "attribute", None)
        if column == ("timestamp",) and isinstance(
                f, (GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual, EqualTo)):
            us = client.datetime_ns(f.value) // _US
            low = {GreaterThan: us + 1, GreaterThanOrEqual: us, EqualTo: us}.get(type(f))
            high = {LessThan: us, LessThanOrEqual: us + 1, EqualTo: us + 1}.get(type(f))
            if low is not None:
                self.o.since_ns = max(low * _US, self.o.since_ns or low * _US)
            if high is not None:
                self.o.until_ns = min(high * _US, self.o.until_ns or high * _US)
            if self.o.since_ns is not None and self.o.until_ns is not None:
                self.o.until_ns = max(self.o.until_ns, self.o.since_ns)
            return True
        if column == ("partition",) and isinstance(f, (EqualTo, In)):
            values = {f.value} if isinstance(f, EqualTo) else set(f.value)
            keep = frozenset(v for v in values if isinstance(v, int))
            self.o.partitions = keep if self.o.partitions is None else self.o.partitions & keep
            return True
        return False

    def plan(self) -> list[Split]:
        ws = client.windows(self.o)
        for note in client.check_retention(self.o, ws):
            print(f"nsq source: warning: {note}", file=sys.stderr)
        return client.splits(self.o, ws)

    def partitions(self):
        found = self.plan()
        return [NsqPartition(s) for s in found] or [NsqPartition(None)]

    def read(self, partition: NsqPartition):
        if partition.split is None:
            return iter(())
        return client.read_split(partition.split, self.o.timeout_s, self.o.retry_s)


class NsqStreamReader(DataSourceStreamReader):
    """Offsets: {"<partition>": virtual offset}. The first batch starts at `since` (the
    oldest record kept without it); each batch ends at the committed ends."""

    def __init__(self, options: Options):
        self.o = options
        self._nodes: dict[int, list[str]] = {}
        self._kept: dict[int, int] = {}  # partition -> the oldest offset kept

    def initialOffset(self) -> dict:
        ws = client.windows(Options(**{**self.o.__dict__, "until_ns": None}))
        self._nodes = {w.partition: w.nodes for w in ws}
        return {str(w.partition): w.start for w in ws}

    def latestOffset(self, start=None, limit=None) -> dict:
        ws = client.windows(Options(**{**self.o.__dict__, "since_ns": None, "until_ns": None}))
        self._nodes = {w.partition: w.nodes for w in ws}
        self._kept = {w.partition: w.start for w in ws}
        latest = {str(w.partition): w.end for w in ws}
        for p, offset in (start or {}).items():  # never behind what was read
            latest[p] = max(latest.get(p, offset), offset)
        return latest

    def partitions(self, start: dict, end: dict):
        if not self._nodes:
            self.latestOffset()
        out = []
        for p, stop in sorted(end.items(), key=lambda kv: int(kv[0])):
            begin = start.get(p)
            if begin is None:  # a partition new since the last batch: from its start
                begin = self._kept.get(int(p), 0)
            if stop > begin:
                w = client.Window(int(p), begin, stop, 0, self._nodes.get(int(p), []), {})
                out.extend(client.splits(self.o, [w]))
        return [NsqPartition(s) for s in out]

    def read(self, partition: NsqPartition):
        return client.read_split(partition.split, self.o.timeout_s, self.o.retry_s)

    def commit(self, end: dict) -> None:
        pass  # the log is the source of truth: nothing to acknowledge


def register(session) -> None:
    """Make `format("nsq")` known to `session`, with the filter pushdown it needs."""
    session.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    session.dataSource.register(NsqDataSource)


__all__ = ["NsqDataSource", "NsqSourceError", "register"]
