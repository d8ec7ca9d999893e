"""Options of nsqlookupd: one dataclass, defaults beside the flags, classic flag names.

Flags are spelled as Go's flag package takes them: `-flag` or `--flag`, `=value` or the
value as the next argument; prefixes of names are refused. Durations take Go's forms
("5m0s", "45s", "1h30m") or plain milliseconds (nsqwire.httpapi.go_duration_ms, as nsqd's
and nsqadmin's flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import socket
from dataclasses import dataclass, field

from nsqwire import adminkey
from nsqwire.httpapi import go_duration_ms

from isr.etcd import parse_endpoints
from isr.keys import check_cluster

def parse_duration_s(text: str) -> float:
    """Seconds of a Go duration ("5m0s", "500ms") or of a plain number of ms: a flag's type."""
    try:
        return go_duration_ms(text) / 1000
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def go_duration(seconds: float) -> str:
    """A duration as Go prints time.Duration for whole seconds: 5m0s, 45s, 1h0m0s."""
    s = int(seconds)
    if s != seconds:
        return f"{seconds * 1000:g}ms"
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    return f"{m}m{s}s" if m else f"{s}s"


@dataclass
class Options:
    tcp_address: str = "0.0.0.0:4160"
    http_address: str = "0.0.0.0:4161"
    broadcast_address: str = field(default_factory=socket.gethostname)
    broadcast_tcp_port: int = 0  # 0: the port of tcp_address (cluster mode registration)
    broadcast_http_port: int = 0
    inactive_producer_timeout: float = 300.0  # seconds
    tombstone_lifetime: float = 45.0  # seconds
    log_level: str = "info"
    log_format: str = "console"
    # cluster mode (nsqlookupd/cluster.py) when etcd_endpoints is given
    etcd_endpoints: str = ""
    cluster_id: str = "nsq"
    etcd_lease_ttl: float = 5.0  # seconds, whole
    default_partitions: int = 2
    default_replicas: int = 1
    # the master's balancer (nsqlookupd/balancer.py): leaders at any time, replicas only
    # inside the window (none without one)
    balance_window: str = ""
    balance_tolerance: int = 1
    balance_interval: float = 10.0  # seconds between two replica moves
    leader_balance: str = "on"
    leader_balance_settle: float = 10.0  # seconds a node is live before it takes leaders
    admin_secret_file: str = ""  # HTTP calls that change state need its secret (http.py)

    @property
    def cluster_mode(self) -> bool:
        return bool(self.etcd_endpoints)

    @property
    def tcp_host_port(self) -> tuple[str, int]:
        return split_address(self.tcp_address)

    @property
    def http_host_port(self) -> tuple[str, int]:
        return split_address(self.http_address)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "0.0.0.0", int(port)


def _address(text: str) -> str:
    try:
        split_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid address {text!r} (want <addr>:<port>)")
    return text


_HELP = {
    "tcp_address": "<addr>:<port> to listen on for TCP clients",
    "http_address": "<addr>:<port> to listen on for HTTP clients",
    "broadcast_address": "address of this lookupd node (default: the host name)",
    "broadcast_tcp_port": "TCP port this lookupd is registered with in etcd (0: the port "
                          "it listens on)",
    "broadcast_http_port": "HTTP port this lookupd is registered with in etcd (0: the port "
                           "it listens on)",
    "inactive_producer_timeout": "duration of time a producer will remain in the active "
                                 "list since its last ping",
    "tombstone_lifetime": "duration of time a producer will remain tombstoned if "
                          "registration remains",
    "log_level": "debug, info, warning or error",
    "log_format": "console or json",
    "etcd_endpoints": "etcd client URLs, comma-separated (http://127.0.0.1:2379): "
                      "cluster mode when given",
    "cluster_id": "the cluster's name in etcd (keys under /nsq/<id>/)",
    "etcd_lease_ttl": "lease of this lookupd's registration and master key (whole seconds)",
    "default_partitions": "partitions of a /topic/create without partition_num (cluster mode)",
    "default_replicas": "replicas of a /topic/create without replicator (cluster mode)",
    "balance_window": "HH:MM-HH:MM (local time) when the master may move replicas (copy "
                      "data) to balance nodes; 00:00-24:00 always; empty: never",
    "balance_tolerance": "balanced when partitions held and led per node differ by at most this",
    "balance_interval": "least time between two replica moves of the balancer",
    "leader_balance": "on: the master evens the partitions each node leads at any time "
                      "(moving a leader inside its ISR copies no data); off: only inside "
                      "--balance-window",
    "leader_balance_settle": "a node takes leaders from the balancer only once live this long",
    "admin_secret_file": "file whose first line is the admin secret: every HTTP call but GET "
                         "then needs 'Authorization: Bearer <secret>', and calls to nsqd "
                         "send it (the same secret on every daemon)",
}


def _window(text: str) -> str:
    from .balancer import parse_window
    try:
        parse_window(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    return text

def _lease_ttl(text: str) -> float:
    seconds = parse_duration_s(text)
    if seconds < 1 or seconds != int(seconds):
        raise argparse.ArgumentTypeError(f"invalid lease ttl {text!r} (whole seconds, >= 1s)")
    return seconds


def _count(lo: int, hi: int):
    def parse(text: str) -> int:
        if not re.fullmatch(r"\d+", text) or not lo <= int(text) <= hi:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} (want {lo}..{hi})")
        return int(text)
    return parse


_TYPES = {"tcp_address": _address, "http_address": _address,
          "inactive_producer_timeout": parse_duration_s, "tombstone_lifetime": parse_duration_s,
          "etcd_lease_ttl": _lease_ttl, "default_partitions": _count(1, 1024),
          "default_replicas": _count(1, 5), "balance_window": _window,
          "balance_tolerance": _count(1, 1024), "balance_interval": parse_duration_s,
          "leader_balance_settle": parse_duration_s,
          "broadcast_tcp_port": _count(0, 65535), "broadcast_http_port": _count(0, 65535)}
_CHOICES = {"log_level": ("debug", "info", "warning", "error"),
            "log_format": ("console", "json"), "leader_balance": ("on", "off")}


def parser(version: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nsqlookupd", description="NSQ-compatible lookup daemon",
                                allow_abbrev=False)
    p.add_argument("--version", action="version", version=version,
                   help="print the version and exit")
    for f in dataclasses.fields(Options):
        default = f.default
        if isinstance(default, float):
            shown = f" (default {go_duration(default)})"
        elif isinstance(default, str):
            shown = f' (default "{default}")'
        elif isinstance(default, int):
            shown = f" (default {default})"
        else:
            shown = ""
        p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=argparse.SUPPRESS,
                       type=_TYPES.get(f.name, str), choices=_CHOICES.get(f.name),
                       metavar={"float": "duration", "int": "int"}.get(f.type, "string"),
                       help=_HELP[f.name] + shown)
    return p


_GO_FLAG = re.compile(r"--?([A-Za-z][A-Za-z0-9_-]*)(=.*)?", re.S)


def go_style(argv: list[str], known: set[str]) -> list[str]:
    """`-flag` as `--flag`, and a flag's next argument as its value whatever it looks like."""
    out = []
    args = iter(argv)
    for arg in args:
        m = _GO_FLAG.fullmatch(arg)
        flag = "--" + m.group(1) if m else None
        if flag not in known:
            out.append(arg)
        elif m.group(2) is not None or flag in ("--version", "--help"):
            out.append(flag + (m.group(2) or ""))
        else:
            value = next(args, None)
            out.append(flag if value is None else f"{flag}={value}")
    return out


def from_args(argv: list[str], version: str) -> Options:
    """Options from the command line; argparse exits 2 (with one line) on a bad flag."""
    p = parser(version)
    known = {o for a in p._actions for o in a.option_strings}
    options = Options(**vars(p.parse_args(go_style(argv, known))))
    if options.admin_secret_file:
        try:
            adminkey.read_secret(options.admin_secret_file)
        except ValueError as e:
            p.error(str(e))
    if options.cluster_mode:
        try:
            parse_endpoints(options.etcd_endpoints)
            check_cluster(options.cluster_id)
        except ValueError as e:
            p.error(str(e))
    return options
