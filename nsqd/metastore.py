"""MetaStore: node-local metadata (topics, channels, cursors) in SQLite through sqlitedict.

Keys: `topic/<topic>` -> {"partitions": [...], "paused": bool, "floors": {partition: offset}},
`channel/<topic>/<partition>/<channel>` -> a channel's checkpoint (Channel.checkpoint:
"confirmed", "confirmed_count", "next_read", "finished" and "attempts" as packed bytes,
"paused", "delay_store"; a checkpoint written before the window was saved has only the first
three and the flags, and reads as "no finished ranges").
All keys live in one table, so one `flush` is one SQLite transaction: a crash
leaves the previous state or the new one, never a mix. Ephemeral topics and
channels are never stored.

`put` and `delete` only note the change on the event loop (the last one of a key wins);
`flush` pickles, writes and commits them in a worker thread, one flush at a time and in
the order they were made. A read sees the changes a running flush writes and those
not flushed yet, over what is in the database.

Durable at `flush`: sqlitedict turns SQLite's syncing off (`synchronous=OFF`), so the
store turns it back on at EXTRA: FULL syncs the journal and the database, and EXTRA also
syncs the folder once the journal is deleted, without which a power cut brings the
journal back and rolls the last transaction back (tests/test_power_loss.py).
"""

from __future__ import annotations

import asyncio

from sqlitedict import SqliteDict

_DELETED = object()


def topic_key(topic: str) -> str:
    return f"topic/{topic}"


def channel_key(topic: str, partition: int, channel: str) -> str:
    return f"channel/{topic}/{partition}/{channel}"


class MetaStore:
    def __init__(self, path: str):
        self._db = SqliteDict(path, tablename="meta", autocommit=False)
        self._pending: dict[str, object] = {}  # key -> value, or _DELETED
        self._prefixes: list[str] = []  # delete_prefix calls not flushed yet (applied first)
        self._flushing: tuple[dict[str, object], list[str]] = ({}, [])  # what a flush writes
        self._lock = asyncio.Lock()
        self._db.conn.execute("PRAGMA synchronous=EXTRA")  # its one connection, before any write

    def topics(self) -> dict[str, dict]:
        """Stored topics by name (read once at start)."""
        return {k[len("topic/"):]: v for k, v in self._items("topic/").items()}

    def channels(self, topic: str) -> dict[tuple[int, str], dict]:
        prefix = f"channel/{topic}/"
        out = {}
        for k, v in self._items(prefix).items():
            partition, name = k[len(prefix):].split("/", 1)
            out[(int(partition), name)] = v
        return out

    def all_channels(self) -> dict[str, dict[tuple[int, str], dict]]:
        """Stored channels of every topic, by topic name (each as `channels` gives them),
        in one read (at start)."""
        out: dict[str, dict[tuple[int, str], dict]] = {}
        for k, v in self._items("channel/").items():
            topic, partition, name = k[len("channel/"):].split("/", 2)
            out.setdefault(topic, {})[(int(partition), name)] = v
        return out

    def _items(self, prefix: str) -> dict[str, object]:
        """Stored items under `prefix`, with the changes a flush is writing and those not
        flushed yet over them (read from any thread)."""
        layers = [self._flushing, (dict(self._pending), list(self._prefixes))]
        out = {k: v for k, v in self._db.items() if k.startswith(prefix)}
        for changes, prefixes in layers:
            out = {k: v for k, v in out.items() if not any(k.startswith(p) for p in prefixes)}
            for k, v in changes.items():
                if k.startswith(prefix):
                    if v is _DELETED:
                        out.pop(k, None)
                    else:
                        out[k] = v
        return out

    def get(self, key: str):
        """One stored value (with the changes not flushed yet), or None."""
        return self._items(key).get(key)

    def put(self, key: str, value: dict) -> None:
        """Store `value` at the next flush. It must not change until then (pass a new one)."""
        self._pending[key] = value

    def delete(self, key: str) -> None:
        self._pending[key] = _DELETED

    def delete_prefix(self, prefix: str) -> None:
        for k in self._pending:
            if k.startswith(prefix):
                self._pending[k] = _DELETED
        self._prefixes.append(prefix)

    async def flush(self) -> None:
        """Write and commit what was put since the last flush (one transaction), off the
        event loop; nothing at all when nothing was (once a running flush ended: what it
        writes is durable when this returns). When it fails, the changes stay pending for
        the next flush."""
        async with self._lock:
            if not self._pending and not self._prefixes:
                return
            batch, prefixes = self._pending, self._prefixes
            self._pending, self._prefixes = {}, []
            self._flushing = (batch, prefixes)
            try:
                await asyncio.to_thread(self._write, batch, prefixes)
            except BaseException:
                self._keep(batch, prefixes)
                raise
            finally:
                self._flushing = ({}, [])

    def _keep(self, batch: dict[str, object], prefixes: list[str]) -> None:
        """Put a failed flush's changes back under the newer ones."""
        newer = self._prefixes
        for k, v in batch.items():
            if k not in self._pending and not any(k.startswith(p) for p in newer):
                self._pending[k] = v
        self._prefixes = prefixes + newer

    def _write(self, batch: dict[str, object], prefixes: list[str]) -> None:
        db = self._db
        for prefix in prefixes:
            for k in [k for k in db.keys() if k.startswith(prefix)]:
                del db[k]
        for k, v in batch.items():
            if v is _DELETED:
                db.pop(k, None)
            else:
                db[k] = v
        db.commit(blocking=True)

    def close(self) -> None:
        batch, prefixes = self._pending, self._prefixes
        self._pending, self._prefixes = {}, []
        self._write(batch, prefixes)
        self._db.close()
