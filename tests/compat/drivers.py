"""One driver per client library, all with the same interface:

    result = await DRIVERS[name].run(params, on_event=None, timeout=60)

`params["scenario"]` names the scenario (see compat_util's docstring)."""

from __future__ import annotations

import asyncio
import os
import shutil

from compat_util import COMPAT_DIR, JS_DIR, PYTHON, run_process


class InProcess:
    def __init__(self, name: str, module: str):
        self.name = name
        self.module = module

    async def run(self, params: dict, on_event=None, timeout: float = 60) -> dict:
        import importlib

        mod = importlib.import_module(self.module)
        return await asyncio.wait_for(mod.run(params, on_event), timeout)


class Subprocess:
    def __init__(self, name: str, argv: list[str], cwd: str):
        self.name = name
        self.argv = argv
        self.cwd = cwd

    async def run(self, params: dict, on_event=None, timeout: float = 60) -> dict:
        return await run_process(self.argv, params, timeout, on_event, cwd=self.cwd)


DRIVERS = {
    "pynsq": InProcess("pynsq", "drv_pynsq"),
    "ansq": InProcess("ansq", "drv_ansq"),
    # gevent monkey-patches sockets and threads: keep it out of pytest's interpreter.
    "gnsq": Subprocess("gnsq", [PYTHON, os.path.join(COMPAT_DIR, "gnsq_scenarios.py")],
                       COMPAT_DIR),
    "nsqjs": Subprocess("nsqjs", [shutil.which("node") or "node",
                                  os.path.join(JS_DIR, "scenarios.js")], JS_DIR),
}
