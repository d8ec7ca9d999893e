"""Options of nsqd: one dataclass, defaults beside the flags, classic flag names.

Durations take Go's forms ("60s", "100ms", "1h30m") or plain milliseconds.
A `--config` TOML file uses the flag names with underscores (as classic nsqd's
config file does); flags given on the command line win over the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import socket
import tomllib
from dataclasses import dataclass, field

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_MS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def parse_duration_ms(text: str | int | float) -> int:
    """Milliseconds of a Go duration string ("1m30s") or of a plain number of ms."""
    if isinstance(text, (int, float)):
        return int(text)
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_MS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"invalid duration {text!r}")
    return int(total)


@dataclass
class Options:
    # network
    tcp_address: str = "0.0.0.0:4150"
    http_address: str = "0.0.0.0:4151"
    broadcast_address: str = field(default_factory=socket.gethostname)
    broadcast_tcp_port: int = 0  # 0: the port of tcp_address
    broadcast_http_port: int = 0
    lookupd_tcp_address: list[str] = field(default_factory=list)
    # storage
    data_path: str = "."
    segment_bytes: int = 100 * 1024 * 1024
    sync_every: int = 1  # messages per sync; 1 = every batch is synced before OK (durable)
    sync_timeout_ms: int = 2000  # with sync_every > 1, also sync when data is this old
    mem_queue_size: int = 10000  # accepted for compatibility; every message goes to disk
    retention_max_age_ms: int = 0  # 0: keep what a channel still needs, forever
    retention_max_bytes: int = 0  # 0: no size bound per partition
    retention_check_interval_ms: int = 10_000
    # messages
    max_msg_size: int = 1024 * 1024
    max_body_size: int = 5 * 1024 * 1024
    msg_timeout_ms: int = 60_000
    max_msg_timeout_ms: int = 15 * 60_000
    max_req_timeout_ms: int = 72 * 3_600_000  # REQ and DPUB delays (ours: the delay queue)
    delay_threshold_ms: int = 60_000  # a delay this long goes to the channel's disk delay queue
    delay_after_attempts: int = 10  # a message delivered this often waits on disk between tries
    max_rdy_count: int = 2500
    max_channel_window: int = 100_000  # taken-but-unconfirmed messages per channel
    # clients
    max_heartbeat_interval_ms: int = 60_000
    max_output_buffer_size: int = 64 * 1024
    max_output_buffer_timeout_ms: int = 30_000
    min_output_buffer_timeout_ms: int = 25
    snappy: bool = True
    deflate: bool = True
    max_deflate_level: int = 6
    # security
    tls_cert: str = ""
    tls_key: str = ""
    tls_root_ca_file: str = ""
    tls_client_auth_policy: str = ""
    tls_required: int = 0
    auth_http_address: list[str] = field(default_factory=list)
    # logs
    log_level: str = "info"
    log_format: str = "console"

    @property
    def tcp_host_port(self) -> tuple[str, int]:
        return _split(self.tcp_address)

    @property
    def http_host_port(self) -> tuple[str, int]:
        return _split(self.http_address)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "0.0.0.0", int(port)


_DURATIONS = {
    "sync_timeout": "sync_timeout_ms", "msg_timeout": "msg_timeout_ms",
    "max_msg_timeout": "max_msg_timeout_ms", "max_req_timeout": "max_req_timeout_ms",
    "max_heartbeat_interval": "max_heartbeat_interval_ms",
    "max_output_buffer_timeout": "max_output_buffer_timeout_ms",
    "min_output_buffer_timeout": "min_output_buffer_timeout_ms",
    "retention_max_age": "retention_max_age_ms",
    "delay_threshold": "delay_threshold_ms",
    "retention_check_interval": "retention_check_interval_ms",
}
_LISTS = {"lookupd_tcp_address", "auth_http_address"}
_BOOLS = {"snappy", "deflate"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nsqd", description="durable NSQ-compatible daemon",
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="TOML config file (flag names with underscores)")
    for f in dataclasses.fields(Options):
        name = f.name
        if name.endswith("_ms") and name[:-3] in _DURATIONS:
            name = name[:-3]
        flag = "--" + name.replace("_", "-")
        if name in _LISTS:
            p.add_argument(flag, action="append", dest=name)
        elif name in _BOOLS:
            p.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "yes"), dest=name,
                           nargs="?", const=True)
        elif name in _DURATIONS:
            p.add_argument(flag, type=parse_duration_ms, dest=name)
        elif f.type in ("int", int):
            p.add_argument(flag, type=int, dest=name)
        else:
            p.add_argument(flag, dest=name)
    return p


def from_args(argv: list[str] | None = None) -> Options:
    args = vars(parser().parse_args(argv))
    values: dict = {}
    config = args.pop("config", None)
    if config:
        with open(config, "rb") as f:
            for key, value in tomllib.load(f).items():
                values[key.replace("-", "_")] = value
    values.update(args)
    return build(values)


def build(values: dict) -> Options:
    """Options from flag-named values (durations converted, unknown names refused)."""
    known = {f.name for f in dataclasses.fields(Options)}
    kwargs = {}
    for key, value in values.items():
        if key in _DURATIONS:
            kwargs[_DURATIONS[key]] = parse_duration_ms(value)
        elif key in known:
            kwargs[key] = value
        else:
            raise ValueError(f"unknown option {key!r}")
    for key in _LISTS:
        if isinstance(kwargs.get(key), str):
            kwargs[key] = [kwargs[key]]
    options = Options(**kwargs)
    if not 0 < options.max_req_timeout_ms <= MAX_DELAY_MS:
        raise ValueError("--max-req-timeout must be between 1ms and 7 days (168h)")
    return options


MAX_DELAY_MS = 7 * 24 * 3_600_000  # the longest delay the delay queue accepts
