"""Dead letters in a run (`--poison N`): the channel made to bury what fails, and what it
buried read back at the end (nsqd/deadletters.py).

- `setup`: `max_attempts` on the run's channel of every partition, through each nsqd's
  `/channel/config` (a node answers for the partitions it leads), asked again until every
  partition's leader reports it in /stats; the setting travels with the channel's state,
  so a new leader keeps it.
- `collect`: every node's dead letters of the channel (`/channel/dead`, page by page),
  each recorded in the history as a `dead` operation whose value is the message's (its
  body's JSON) with the dead letter's `dead_id`, `cause` and `attempts`.
"""

from __future__ import annotations

import json
import time
import urllib.parse

from jepsen.cluster import http_json

SETUP_S = 30.0
COLLECT_S = 60.0  # a node reads its dead letters back after a restart: 503 until then
PAGE = 1000


def _query(topic: str, channel: str, **more) -> str:
    return urllib.parse.urlencode({"topic": topic, "channel": channel, **more})


def setup(cluster, topic: str, channel: str, max_attempts: int, partitions: int) -> None:
    deadline = time.monotonic() + SETUP_S
    while True:
        covered = set()
        for h in cluster.hosts:
            http_json("POST", f"http://{h.nsqd_http}/channel/config?"
                              f"{_query(topic, channel, max_attempts=max_attempts)}")
            status, stats = http_json("GET", f"http://{h.nsqd_http}/stats?format=json&"
                                             f"topic={urllib.parse.quote(topic)}")
            for t in (stats or {}).get("topics", []) if status == 200 else ():
                for c in t.get("channels", []):
                    if c.get("channel_name") == channel:
                        covered |= {p["partition"] for p in c.get("partitions", [])
                                    if p.get("max_attempts") == max_attempts}
        if len(covered) == partitions:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"max_attempts not set on partitions "
                               f"{sorted(set(range(partitions)) - covered)} within {SETUP_S} s")
        time.sleep(0.2)


def collect(cluster, topic: str, channel: str, history) -> int:
    """Record every dead letter of the channel; how many."""
    n = 0
    for h in cluster.hosts:
        after = None
        deadline = time.monotonic() + COLLECT_S
        while True:
            more = {"limit": PAGE, **({"after": after} if after else {})}
            status, page = http_json("GET", f"http://{h.nsqd_http}/channel/dead?"
                                            f"{_query(topic, channel, **more)}", timeout=10)
            if status == 404:  # leads no partition of it (or has no such channel)
                break
            if status != 200 or page["loading"]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{h.name}: dead letters unread: {status} {page}")
                time.sleep(0.5)
                continue
            for d in page["dead_letters"]:
                try:
                    value = json.loads(d.get("body") or "")
                except ValueError:
                    value = {"id": None, "raw": (d.get("body") or "")[:100]}
                history.record("ok", "dead", "collector",
                               dict(value, dead_id=d["id"], cause=d["cause"],
                                    attempts=d["attempts"]), h.name)
                n += 1
            if len(page["dead_letters"]) < PAGE:
                break
            after = page["dead_letters"][-1]["id"]
    return n
