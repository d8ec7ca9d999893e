"""The `nsqd` console script: parse flags, build the node (`build`: the composition root,
which hands NSQD its TCP and HTTP servers and its cluster driver), run until
SIGTERM/SIGINT, then drain and exit.

Exit codes: 0 after a clean stop; 1 when the stop closed what it could but something
could not be persisted (a full disk: the `stopped_with_errors` line names it; every
acknowledged message is on disk, the cursors may lag); 2 for bad flags."""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import resource
import signal
import sys
from importlib.metadata import PackageNotFoundError, version

from diskqueue.runtime import tune_gc

from .cluster import Cluster
from .http import start_http
from .logs import configure
from .nsqd import NSQD, VERSION
from .options import Options, from_args
from .tcp import start_tcp, tls_context

_LISTEN_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


class StartError(Exception):
    """A start-up failure the operator fixes (a port in use): one line, no traceback."""


def version_line() -> str:
    """What `nsqd --version` prints: the classic version we speak, then ours."""
    try:
        ours = version("durable-nsq")
    except PackageNotFoundError:
        ours = "unknown"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"nsqd v{VERSION} (durable-nsq {ours}, python {python})"


def build(options: Options) -> NSQD:
    """The node wired to its TCP and HTTP servers and its cluster driver: what `nsqd` runs
    and what tests start in-process (`await build(options).start()`). A TLS certificate
    that does not load fails here, before the node opens anything."""
    tls = tls_context(options)
    return NSQD(options, start_tcp=functools.partial(start_tcp, tls=tls),
                start_http=functools.partial(start_http, tls=tls), make_cluster=Cluster)


async def serve(options) -> bool:
    """Run a node until SIGTERM/SIGINT; True when it stopped cleanly (NSQD.stop)."""
    nsqd = build(options)
    tune_gc()  # before the start too: its collections were 2.2 s of a start of 10,000 partitions
    try:
        await nsqd.start()
    except OSError as e:
        if e.errno not in _LISTEN_ERRORS or "bind" not in str(e):
            raise  # not a listener (a data path we may not write is its own error)
        flag, address = (("--tcp-address", options.tcp_address) if nsqd.tcp_server is None
                         else ("--http-address", options.http_address) if nsqd.cluster is None
                         else ("--rpc-address", options.rpc_address))
        raise StartError(f"cannot listen on {address} ({flag}): "
                         f"{os.strerror(e.errno).lower()}") from None
    tune_gc()  # freezes what the start built
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    return await nsqd.stop()


def raise_open_files_limit() -> None:
    """The soft limit on open files raised to the hard one, as Go raises it for classic
    nsqd: a node holds two files a partition while it writes, and a reader's segment while
    a channel reads (nsqd/README.md, "Descriptors"), so 1,024 (a common soft default) is
    reached at a few hundred busy partitions."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # not allowed here: the limit stays as it was
            pass


def main(argv: list[str] | None = None) -> int:
    try:
        options = from_args(argv, version_line())
    except ValueError as e:
        print(f"nsqd: {e}", file=sys.stderr)
        return 2
    configure(options.log_level, options.log_format)
    raise_open_files_limit()
    try:
        import uvloop
    except ImportError:
        run = asyncio.run
    else:
        run = uvloop.run
    try:
        clean = run(serve(options))
    except StartError as e:
        print(f"nsqd: {e}", file=sys.stderr)
        return 1
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
