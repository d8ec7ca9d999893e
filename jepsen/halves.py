"""Half messages in a run (`--halves N`, nsqd/halves.py): which messages are halves and
how each is decided, the nsqd flags that make undecided ones checked back within a run,
and the producers' check-back server.

- `kind_of(seq, every)`: every `every`-th message of an nsqclient producer is a half, the
  k-th of them (k = seq // every) of kind KINDS[k % 4]: "commit" and "rollback" are
  decided by the producer, "check-commit" and "check-rollback" by the check-back.
- `CheckServer`: answers every check-back by the kind in the half's body (a commit kind:
  commit; a rollback kind: rollback; a body that is not a half's: no decision) and records
  each answer in the history as a `check-back` operation (the half's value with
  `half_id`, `checks` and `decision`; `node`: the nsqd that asked).

A value of a rollback kind must never be delivered, whatever its enqueue's outcome: its
producer or the check-back rolls it back, and nothing commits it (see total_queue).
"""

from __future__ import annotations

import base64
import json

from aiohttp import web

from jepsen.history import History

KINDS = ("commit", "rollback", "check-commit", "check-rollback")
ROLLED_BACK = ("rollback", "check-rollback")
NSQD_FLAGS = ("--half-check-timeout", "2s")  # undecided halves are checked back within a run


def kind_of(seq: int, every: int) -> str | None:
    """The kind of the producer's `seq`-th message when it is a half, else None."""
    if not every or seq % every != every - 1:
        return None
    return KINDS[seq // every % len(KINDS)]


def rolled_back(value: dict) -> bool:
    """Whether a value is a half that is rolled back (by its producer or the check-back)."""
    return value.get("half") in ROLLED_BACK


class CheckServer:
    """The check-back URL of every producer, on `host` (where the nsqds reach the harness),
    from `start()` to `stop()`."""

    def __init__(self, history: History, host: str):
        self.history, self.host = history, host
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> "CheckServer":
        app = web.Application()
        app.router.add_post("/check", self._check)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, 0).start()
        self.url = "http://{}:{}/check".format(*self._runner.addresses[0][:2])
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _check(self, request: web.Request) -> web.Response:
        payload = await request.json()
        try:
            value = json.loads(base64.b64decode(payload["body"]))
        except (KeyError, TypeError, ValueError):
            value = None
        if not isinstance(value, dict):
            value = {"id": None}
        kind = value.get("half")
        decision = None if kind not in KINDS else "rollback" if kind in ROLLED_BACK else "commit"
        self.history.record("ok", "check-back", "check-server",
                            dict(value, half_id=payload.get("id"), checks=payload.get("checks"),
                                 decision=decision), request.remote)
        return web.json_response({"decision": decision})
