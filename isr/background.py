"""How a background task of isr stops: cancelled, then awaited until it has ended."""

from __future__ import annotations

import asyncio


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel `task` (None: nothing) and wait until it has ended; its cancellation is not
    an error, anything else it raised is."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
