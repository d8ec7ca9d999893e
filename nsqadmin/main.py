"""The `nsqadmin` console script: parse flags, poll and serve until SIGTERM/SIGINT, exit 0.

Exit codes: 0 after a clean stop (and after `--version`); 1 when the port cannot be bound or
the password file or the admin secret file cannot be read (one line); 2 for bad flags
(argparse's one line)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from importlib.metadata import PackageNotFoundError, version

import structlog
from aiohttp import web

from nsqwire import adminkey

from . import auth
from .app import make_app, make_runner
from .options import from_args, split_address
from .source import Source

log = structlog.get_logger("nsqadmin")
VERSION = "1.3.0"  # the Go nsqadmin whose pages and /api/ this one stands in for


def version_line() -> str:
    """What `nsqadmin --version` prints, shaped as nsqd's and nsqlookupd's line."""
    try:
        ours = version("durable-nsq")
    except PackageNotFoundError:
        ours = "unknown"
    return (f"nsqadmin v{VERSION} (durable-nsq {ours}, python "
            f"{sys.version_info.major}.{sys.version_info.minor})")


class StartError(Exception):
    """A start-up failure the operator fixes: one line, no traceback."""


def configure_logs(level: str) -> None:
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info,
                    structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True)


async def serve(options) -> None:
    try:
        users = auth.load_users(options.admin_user, options.admin_password_file)
        secret = (adminkey.read_secret(options.admin_secret_file)
                  if options.admin_secret_file else "")
    except (auth.BadPasswordFile, ValueError) as e:
        raise StartError(str(e)) from None
    source = Source(options, secret)
    app = make_app(source, auth.Auth(users, options.require_login_for_reads),
                   refresh_s=max(2.0, options.poll_interval))
    runner = make_runner(app)
    await runner.setup()
    host, port = split_address(options.http_address)
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except OSError as e:
        await runner.cleanup()
        raise StartError(f"cannot listen on {options.http_address} (--http-address): "
                         f"{e.strerror}") from None
    await source.start()
    log.info("listening", http=options.http_address,
             lookupd=options.lookupd_http_address, nsqd=options.nsqd_http_address,
             mode=source.snapshot.mode, logins=bool(users))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await source.stop()
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    options = from_args(sys.argv[1:] if argv is None else argv, version_line())
    configure_logs(options.log_level)
    try:
        asyncio.run(serve(options))
    except StartError as e:
        print(f"nsqadmin: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
