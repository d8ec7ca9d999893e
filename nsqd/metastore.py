"""MetaStore: node-local metadata (topics, channels, cursors) in SQLite through sqlitedict.

Keys: `topic/<topic>` -> {"partitions": [...], "paused": bool, "floors": {partition: offset}},
`channel/<topic>/<partition>/<channel>` -> {"confirmed", "confirmed_count", "paused"}.
All keys live in one table, so one `flush` is one SQLite transaction: a crash
leaves the previous state or the new one, never a mix. Ephemeral topics and
channels are never stored.

Durable at `flush`: sqlitedict turns SQLite's syncing off (`synchronous=OFF`), so the
store turns it back on at EXTRA: FULL syncs the journal and the database, and EXTRA also
syncs the folder once the journal is deleted, without which a power cut brings the
journal back and rolls the last transaction back (tests/test_power_loss.py).
"""

from __future__ import annotations

import asyncio

from sqlitedict import SqliteDict


def topic_key(topic: str) -> str:
    return f"topic/{topic}"


def channel_key(topic: str, partition: int, channel: str) -> str:
    return f"channel/{topic}/{partition}/{channel}"


class MetaStore:
    def __init__(self, path: str):
        self._db = SqliteDict(path, tablename="meta", autocommit=False)
        self._db.conn.execute("PRAGMA synchronous=EXTRA")  # its one connection, before any write

    def topics(self) -> dict[str, dict]:
        """Stored topics by name (read once at start)."""
        return {k[len("topic/"):]: v for k, v in self._db.items() if k.startswith("topic/")}

    def channels(self, topic: str) -> dict[tuple[int, str], dict]:
        prefix = f"channel/{topic}/"
        out = {}
        for k, v in self._db.items():
            if k.startswith(prefix):
                partition, name = k[len(prefix):].split("/", 1)
                out[(int(partition), name)] = v
        return out

    def put(self, key: str, value: dict) -> None:
        self._db[key] = value

    def delete(self, key: str) -> None:
        self._db.pop(key, None)

    def delete_prefix(self, prefix: str) -> None:
        for k in [k for k in self._db.keys() if k.startswith(prefix)]:
            del self._db[k]

    async def flush(self) -> None:
        """Commit what was put since the last flush (one transaction), off the event loop."""
        await asyncio.to_thread(self._db.commit, True)

    def close(self) -> None:
        self._db.commit(blocking=True)
        self._db.close()
