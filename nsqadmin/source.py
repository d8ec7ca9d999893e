"""Everything nsqadmin reads or asks, over HTTP only (never a node's internals): the poll
of the cluster every --poll-interval (model.build makes the Snapshot, history.History
keeps the samples), the pass-through of trace search and message reads, and the calls
actions.py makes. One aiohttp ClientSession; every call has --http-client-timeout and,
with --admin-secret-file, the daemons' admin key (nsqwire/adminkey.py).

Modes: `nsqd` (--nsqd-http-address: each nsqd alone); with --lookupd-http-address the
lookupd's /info says `cluster` (it has a `cluster` object: etcd behind it) or `classic`.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import structlog

from nsqwire import adminkey

from . import model
from .history import History

log = structlog.get_logger("nsqadmin")


class Source:
    def __init__(self, options, admin_secret: str = ""):
        """`admin_secret`: the daemons' admin key, sent on every call ("" none)."""
        self.options = options
        self.admin_secret = admin_secret
        self.session: aiohttp.ClientSession | None = None
        self.snapshot = model.empty("nsqd" if options.mode == "nsqd" else "classic")
        self.history = History(options.history, options.poll_interval)
        self._poll_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.poll_seconds = 0.0  # how long the last poll took

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.options.http_client_timeout)
        self.session = aiohttp.ClientSession(timeout=timeout,
                                             headers=adminkey.headers(self.admin_secret))
        await self.refresh()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.session:
            await self.session.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.options.poll_interval)
            try:
                await self.refresh()
            except Exception:  # a bug in a poll must not stop the next one
                log.exception("poll_failed")

    # ---- HTTP calls ---------------------------------------------------------------

    async def call(self, method: str, address: str, path: str, params: dict | None = None,
                   body: bytes | None = None) -> tuple[int, object]:
        """(status, JSON body or text) of one call; (0, "why") when the node did not answer."""
        url = f"http://{address}{path}"
        try:
            async with self.session.request(method, url, params=params, data=body) as r:
                raw = await r.read()
                try:
                    return r.status, json.loads(raw) if raw else None
                except ValueError:
                    return r.status, raw.decode("utf-8", "replace")
        except asyncio.TimeoutError:
            return 0, f"no answer within {self.options.http_client_timeout:g} s"
        except aiohttp.ClientError as e:
            return 0, str(e) or type(e).__name__
        except ValueError as e:  # a malformed address or URL
            return 0, str(e)

    async def get(self, address: str, path: str, params: dict | None = None):
        return await self.call("GET", address, path, params)

    # ---- the poll -------------------------------------------------------------------

    async def refresh(self) -> model.Snapshot:
        """Read everything once, then swap the Snapshot in and add it to the history.
        Concurrent calls share one read (an action's refresh waits for a running poll
        and then reads again, so it sees its own effect)."""
        async with self._poll_lock:
            started = time.monotonic()
            snap = await self._read()
            self.snapshot = snap
            self.history.add(snap)
            self.poll_seconds = time.monotonic() - started
            return snap

    async def _read(self) -> model.Snapshot:
        opts = self.options
        lookupds, producers, topic_names = [], [], set()
        mode = "nsqd"
        if opts.lookupd_http_address:
            mode = "classic"
            answers = await asyncio.gather(*(self._read_lookupd(a)
                                             for a in opts.lookupd_http_address))
            seen = set()
            for lk, nodes, names in answers:
                lookupds.append(lk)
                topic_names |= names
                if (lk.get("info") or {}).get("cluster") is not None:
                    mode = "cluster"
                for p in nodes:
                    if model.producer_http(p) not in seen:
                        seen.add(model.producer_http(p))
                        producers.append(p)
            addresses = [model.producer_http(p) for p in producers]
        else:
            addresses = list(opts.nsqd_http_address)
        results = await asyncio.gather(*(self._read_node(a, info=mode == "nsqd")
                                         for a in addresses))
        stats, infos, errors = {}, {}, {}
        for address, (s, info, error) in zip(addresses, results):
            stats[address] = s
            if info:
                infos[address] = info
            if error:
                errors[address] = error
        load, load_note = await self._read_load(lookupds)
        return model.build(mode, time.time(), lookupds, producers, sorted(topic_names), stats,
                           infos, errors, load, load_note)

    async def _read_lookupd(self, address: str):
        (s1, nodes), (s2, topics), (s3, info) = await asyncio.gather(
            self.get(address, "/nodes"), self.get(address, "/topics"),
            self.get(address, "/info"))
        error = next((f"{path}: {body if s == 0 else f'HTTP {s}'}"
                      for path, s, body in (("/nodes", s1, nodes), ("/topics", s2, topics),
                                            ("/info", s3, info)) if s != 200), "")
        lk = {"address": address, "info": info if s3 == 200 and isinstance(info, dict) else None,
              "error": error}
        producers = nodes.get("producers") or [] if s1 == 200 and isinstance(nodes, dict) else []
        names = set(topics.get("topics") or []) if s2 == 200 and isinstance(topics, dict) \
            else set()
        return lk, producers, names

    async def _read_node(self, address: str, info: bool):
        calls = [self.get(address, "/stats", {"format": "json"})]
        if info:
            calls.append(self.get(address, "/info"))
        answers = await asyncio.gather(*calls)
        status, stats = answers[0]
        node_info = answers[1][1] if info and answers[1][0] == 200 else None
        if status != 200 or not isinstance(stats, dict):
            return None, node_info, (stats if status == 0 else f"/stats: HTTP {status}")
        return stats, node_info, ""

    async def _read_load(self, lookupds: list[dict]) -> tuple[dict | None, str]:
        """/cluster/stats from the first lookupd that answers it."""
        if not lookupds:
            return None, "load reports not available: no nsqlookupd (--nsqd-http-address)"
        notes = []
        masters = [((lk.get("info") or {}).get("cluster") or {}).get("master_http_address")
                   for lk in lookupds]
        order = [m for m in masters if m][:1] + [lk["address"] for lk in lookupds
                                                 if lk.get("info") is not None]
        for address in dict.fromkeys(order):  # the master first: it alone may answer
            status, body = await self.get(address, "/cluster/stats")
            if status == 200 and isinstance(body, dict):
                return body, ""
            notes.append(f"{address} answered "
                         f"{'HTTP %d' % status if status else body} to /cluster/stats")
        return None, "load reports not available" + (f" ({'; '.join(notes)})" if notes else "")

    # ---- reads passed through ---------------------------------------------------------

    async def trace_search(self, params: dict) -> tuple[int, dict]:
        """A lookupd's cluster-wide /trace/search, or each nsqd's merged (nsqd mode)."""
        if self.options.lookupd_http_address:
            last = (502, {"message": "NO_LOOKUPD_ANSWERED"})
            for address in self.options.lookupd_http_address:
                status, body = await self.get(address, "/trace/search", params)
                if status:
                    return status, body if isinstance(body, dict) else {"message": str(body)}
                last = (502, {"message": "NO_LOOKUPD_ANSWERED", "detail": body})
            return last
        answers = await asyncio.gather(*(self.get(a, "/trace/search", params)
                                         for a in self.options.nsqd_http_address))
        merged = {"count": 0, "messages": [], "nodes": [], "unreachable": []}
        last_error = None
        for address, (status, body) in zip(self.options.nsqd_http_address, answers):
            if status == 200 and isinstance(body, dict):
                merged["count"] += body.get("count", 0)
                for m in body.get("messages") or ():
                    for e in m.get("events") or ():
                        e.setdefault("node", address)
                    merged["messages"].append(m)
                merged["nodes"].append(address)
                merged["limit"] = body.get("limit")
            elif status == 0:
                merged["unreachable"].append(address)
            else:
                last_error = (status, body if isinstance(body, dict) else {"message": body})
        if not merged["nodes"]:
            return last_error or (503, {"message": "NO_NODE_ANSWERED"})
        if merged["count"] == 0 and last_error and last_error[0] == 404:
            return last_error
        return 200, merged

    async def message_get(self, params: dict) -> tuple[int, dict]:
        """One message's record (for its body): through a lookupd, or from each nsqd."""
        addresses = self.options.lookupd_http_address or self.options.nsqd_http_address
        last = (502, {"message": "NODE_UNREACHABLE"})
        for address in addresses:
            status, body = await self.get(address, "/message/get", params)
            if status == 200 and isinstance(body, dict):
                body.setdefault("node", address)
                return status, body
            if status:
                last = (status, body if isinstance(body, dict) else {"message": str(body)})
        return last
