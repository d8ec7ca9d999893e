"""The `nsqlookupd` console script: parse flags, serve until SIGTERM/SIGINT, exit 0.

Exit codes: 0 after a clean stop; 1 when a port cannot be bound (one line naming the
address and its flag); 2 for bad flags (argparse's one line)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import sys
from importlib.metadata import PackageNotFoundError, version

import structlog

from .nsqlookupd import VERSION, NSQLookupd
from .options import from_args

_LISTEN_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


class StartError(Exception):
    """A start-up failure the operator fixes (a port in use): one line, no traceback."""


def version_line() -> str:
    try:
        ours = version("durable-nsq")
    except PackageNotFoundError:
        ours = "unknown"
    return (f"nsqlookupd v{VERSION} (durable-nsq {ours}, python "
            f"{sys.version_info.major}.{sys.version_info.minor})")


def configure_logs(level: str, fmt: str) -> None:
    """structlog as every process of the project logs: one event per line."""
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer() if fmt == "json"
                    else structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True)


async def serve(options) -> None:
    lookupd = NSQLookupd(options)
    try:
        await lookupd.start()
    except OSError as e:
        if e.errno not in _LISTEN_ERRORS:
            raise
        flag, address = (("--tcp-address", options.tcp_address) if lookupd.tcp_server is None
                         else ("--http-address", options.http_address))
        raise StartError(f"cannot listen on {address} ({flag}): "
                         f"{os.strerror(e.errno).lower()}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await lookupd.stop()


def main(argv: list[str] | None = None) -> int:
    options = from_args(sys.argv[1:] if argv is None else argv, version_line())
    configure_logs(options.log_level, options.log_format)
    try:
        asyncio.run(serve(options))
    except StartError as e:
        print(f"nsqlookupd: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
