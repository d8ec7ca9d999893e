"""Options of nsqadmin: one dataclass, defaults beside the flags, Go nsqadmin's flag names.

`-flag` and `--flag`, `=value` or the value as the next argument, as the other daemons
take them. --lookupd-http-address and --nsqd-http-address may be given several times (or
comma-separated); at least one of them is needed, and not both kinds (as Go nsqadmin).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from nsqwire import adminkey
from nsqwire.httpapi import go_duration_ms

def parse_duration_s(text: str) -> float:
    """Seconds (> 0) of a Go duration ("5s", "500ms") or of a plain number of ms: a flag's type."""
    try:
        seconds = go_duration_ms(text) / 1000
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}")
    return seconds


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(address)
    return host or "0.0.0.0", int(port)


def _address(text: str) -> str:
    try:
        split_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid address {text!r} (want <addr>:<port>)")
    return text


@dataclass
class Options:
    http_address: str = "0.0.0.0:4171"
    lookupd_http_address: list[str] = field(default_factory=list)
    nsqd_http_address: list[str] = field(default_factory=list)
    admin_user: list[str] = field(default_factory=list)
    admin_password_file: str = ""
    require_login_for_reads: bool = False
    admin_secret_file: str = ""  # the daemons' admin key, sent on every call (source.py)
    poll_interval: float = 5.0  # seconds between two reads of every node's /stats
    history: float = 300.0  # seconds of samples kept for the sparklines
    http_client_timeout: float = 3.0  # seconds for one call to a node or lookupd
    log_level: str = "info"

    @property
    def mode(self) -> str:
        """`lookupd` (cluster or classic, told by the lookupd's /info) or `nsqd`."""
        return "lookupd" if self.lookupd_http_address else "nsqd"


def _addresses(values) -> list[str]:
    return [_address(a.strip()) for v in values or () for a in v.split(",") if a.strip()]


def parser(version: str) -> argparse.ArgumentParser:
    """The flags; `version` is what `--version` prints (main.version_line)."""
    p = argparse.ArgumentParser(prog="nsqadmin", allow_abbrev=False,
                                description="web UI and JSON API for the cluster")
    p.add_argument("--version", action="version", version=version,
                   help="print the version and exit")
    p.add_argument("--http-address", type=_address, default="0.0.0.0:4171",
                   help='<addr>:<port> to listen on for HTTP clients (default "0.0.0.0:4171")')
    p.add_argument("--lookupd-http-address", action="append",
                   help="nsqlookupd HTTP address (may be given multiple times)")
    p.add_argument("--nsqd-http-address", action="append",
                   help="nsqd HTTP address, without lookupd (may be given multiple times)")
    p.add_argument("--admin-user", action="append",
                   help="a user allowed to act (create, delete, empty, pause...): "
                        "actions need a login when given (may be given multiple times)")
    p.add_argument("--admin-password-file", default="",
                   help="file of `user:password` lines (or one line: the password of "
                        "every admin user); needed with --admin-user")
    p.add_argument("--require-login-for-reads", action="store_true",
                   help="pages and GET /api/ need a login too (default: reads are open)")
    p.add_argument("--admin-secret-file", default="",
                   help="file whose first line is the admin secret of nsqd and nsqlookupd "
                        "(their --admin-secret-file): sent on every call to them")
    p.add_argument("--poll-interval", type=parse_duration_s, default=5.0,
                   help="how often every node's /stats is read (default 5s)")
    p.add_argument("--history", type=parse_duration_s, default=300.0,
                   help="how long samples are kept for the charts (default 5m)")
    p.add_argument("--http-client-timeout", type=parse_duration_s, default=3.0,
                   help="timeout of one call to a node or a lookupd (default 3s)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   default="info")
    return p


def go_style(argv: list[str]) -> list[str]:
    """`-flag` as `--flag` (Go's flag package takes both)."""
    return ["-" + a if re.match(r"-[a-z][a-z-]+", a) else a for a in argv]


def from_args(argv: list[str], version: str) -> Options:
    """Options from the command line; argparse exits 2 with one line on a bad flag (0 after
    printing `version` for --version)."""
    p = parser(version)
    ns = p.parse_args(go_style(argv))
    try:
        lookupds, nsqds = _addresses(ns.lookupd_http_address), _addresses(ns.nsqd_http_address)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    options = Options(
        http_address=ns.http_address, lookupd_http_address=lookupds, nsqd_http_address=nsqds,
        admin_user=[u for v in ns.admin_user or () for u in v.split(",") if u],
        admin_password_file=ns.admin_password_file,
        require_login_for_reads=ns.require_login_for_reads,
        admin_secret_file=ns.admin_secret_file,
        poll_interval=ns.poll_interval, history=ns.history,
        http_client_timeout=ns.http_client_timeout, log_level=ns.log_level)
    if not options.lookupd_http_address and not options.nsqd_http_address:
        p.error("--lookupd-http-address or --nsqd-http-address required")
    if options.lookupd_http_address and options.nsqd_http_address:
        p.error("use --lookupd-http-address or --nsqd-http-address, not both")
    if options.admin_user and not options.admin_password_file:
        p.error("--admin-user needs --admin-password-file")
    if options.require_login_for_reads and not options.admin_user:
        p.error("--require-login-for-reads needs --admin-user")
    if options.admin_secret_file:
        try:
            adminkey.read_secret(options.admin_secret_file)
        except ValueError as e:
            p.error(str(e))
    return options
