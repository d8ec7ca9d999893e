"""Options of nsqd: one dataclass, defaults beside the flags, classic flag names.

Durations take Go's forms ("60s", "100ms", "1h30m") or plain milliseconds.
A `--config` TOML file uses the flag names with underscores (as classic nsqd's
config file does); flags given on the command line win over the file.

Flags are spelled as Go's flag package takes them: `-flag` or `--flag`, with `=value`
or the value as the next argument (which is then a value even when it starts with a
dash); a flag with an optional value (`--snappy`, `--tls-required`) takes it only
after `=` or, ours, as the next argument when that is not a flag. Prefixes of flag
names are refused, as Go does. `--help` shows each default as Go prints it.

A flag the node cannot honour is refused, never accepted and ignored (_REFUSED).
`--lookupd-tcp-address` (repeatable; config key `nsqlookupd_tcp_addresses`) registers
the node with each nsqlookupd (lookup.py). `--etcd-endpoints` turns on cluster mode
(cluster.py), which refuses `--lookupd-tcp-address` beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import sys
import tomllib
import urllib.parse
from dataclasses import dataclass, field

from isr.etcd import parse_endpoints
from isr.keys import check_cluster
from isr.state import MAX_PARTITIONS, MAX_REPLICAS
from nsqwire import adminkey
from nsqwire.httpapi import go_duration_ms

def parse_duration_ms(text: str | int | float) -> int:
    """Milliseconds of a Go duration string ("1m30s") or of a plain number of ms."""
    if isinstance(text, (int, float)):
        return int(text)
    return int(go_duration_ms(text))


@dataclass
class Options:
    # network
    tcp_address: str = "0.0.0.0:4150"
    http_address: str = "0.0.0.0:4151"
    https_address: str = ""  # the HTTP API over TLS (--tls-cert, --tls-key); "": none
    broadcast_address: str = field(default_factory=socket.gethostname)
    broadcast_tcp_port: int = 0  # 0: the port of tcp_address
    broadcast_http_port: int = 0
    lookupd_tcp_address: list[str] = field(default_factory=list)
    # cluster mode (cluster.py): on when etcd_endpoints is given
    etcd_endpoints: str = ""
    cluster_id: str = "nsq"
    etcd_lease_ttl_ms: int = 5000
    rpc_address: str = "0.0.0.0:4250"  # replication: registered in etcd, served here
    broadcast_rpc_port: int = 0  # 0: the port of rpc_address
    rack: str = ""  # placement's failure domain; "": the host of broadcast_address
    repl_timeout_ms: int = 1000  # a follower that does not ack a push this long leaves the ISR
    commit_timeout_ms: int = 10_000  # a publish not acknowledged this long is answered an error
    default_partitions: int = 2  # of a topic auto-created in etcd by a classic PUB or SUB
    default_replicas: int = 1
    # storage
    data_path: str = "."
    segment_bytes: int = 100 * 1024 * 1024
    sync_every: int = 1  # messages per sync; 1 = every batch is synced before OK (durable)
    sync_timeout_ms: int = 2000  # with sync_every > 1, also sync when data is this old
    journal: bool = True  # journal durable batches: one sync a round (diskqueue/journal.py)
    journal_checkpoint_bytes: int = 64 * 1024 * 1024  # a journal file this long is checkpointed
    mem_queue_size: int = 10000  # accepted for compatibility; every message goes to disk
    retention_max_age_ms: int = 0  # 0: keep what a channel still needs, forever
    retention_min_age_ms: int = 0  # keep history this long even when every channel is past it
    retention_max_bytes: int = 0  # 0: no size bound per partition
    retention_check_interval_ms: int = 10_000
    # message trace (tracing.py, ../trace): off per topic until switched on
    trace_all: bool = False  # trace every topic and channel
    trace_buffer: int = 100_000  # events waiting for the store; beyond, dropped and counted
    trace_retention_max_age_ms: int = 7 * 86_400_000  # 0: keep trace events forever
    trace_retention_max_bytes: int = 1 << 30  # live size of trace.sqlite (0: no bound)
    trace_es_url: str = ""  # the store is Elasticsearch (../trace/es.py), not trace.sqlite
    trace_es_index_prefix: str = "nsq-trace-"  # daily indices <prefix>YYYY.MM.DD
    trace_es_ca_certs: str = ""  # PEM file of the CAs an https Elasticsearch is checked against
    trace_es_username: str = ""  # basic auth, with trace_es_password_file
    trace_es_password_file: str = ""
    trace_es_api_key_file: str = ""  # an API key (the encoded form Elasticsearch gives)
    checkpoint_interval_ms: int = 1000  # cursors are saved this often (and at shutdown)
    test_ack_before_sync: bool = False  # TEST ONLY (jepsen's broken build): never in use
    # messages
    max_msg_size: int = 1024 * 1024
    max_body_size: int = 5 * 1024 * 1024
    msg_timeout_ms: int = 60_000
    max_msg_timeout_ms: int = 15 * 60_000
    max_req_timeout_ms: int = 72 * 3_600_000  # REQ and DPUB delays (ours: the delay queue)
    delay_threshold_ms: int = 60_000  # a delay this long goes to the channel's disk delay queue
    delay_after_attempts: int = 10  # a message delivered this often waits on disk between tries
    half_check_timeout_ms: int = 6000  # a half message undecided this long is checked back
    half_check_max: int = 10  # check-backs without a decision before it is rolled back
    max_rdy_count: int = 2500
    max_channel_window: int = 100_000  # taken-but-unconfirmed messages per channel
    disable_auto_create: bool = False  # PUB/SUB/pub of a missing topic: E_TOPIC_NOT_EXIST
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
    tls_required: int = 0  # 0 no, 1 yes (true: with https_address, HTTP too), 2 TCP only (tcp-https)
    tls_min_version: str = "tls1.0"
    auth_http_address: list[str] = field(default_factory=list)
    admin_secret_file: str = ""  # HTTP calls that change state need its secret (http.py)
    http_legacy_envelope: bool = False  # wrap JSON for requests without the V1 Accept header
    # logs
    log_level: str = "info"
    log_format: str = "console"

    @property
    def tcp_host_port(self) -> tuple[str, int]:
        return _split(self.tcp_address)

    @property
    def http_host_port(self) -> tuple[str, int]:
        return _split(self.http_address)

    @property
    def https_host_port(self) -> tuple[str, int]:
        return _split(self.https_address)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "0.0.0.0", int(port)


_HOST_PORT = re.compile(r"(?:\[([^\[\]]+)\]|([^:\[\]]*)):([0-9]{1,5})")


def lookupd_host_port(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` of an nsqlookupd (an empty host is this machine, as
    Go dials it). ValueError for anything else, so a typo is refused when given, not
    dialled in vain forever."""
    m = _HOST_PORT.fullmatch(address)
    if m is None or not 0 < int(m[3]) < 65536:
        raise ValueError(f"invalid nsqlookupd address {address!r} (want host:port)")
    return m[1] or m[2] or "127.0.0.1", int(m[3])


_DURATIONS = {
    "sync_timeout": "sync_timeout_ms", "msg_timeout": "msg_timeout_ms",
    "max_msg_timeout": "max_msg_timeout_ms", "max_req_timeout": "max_req_timeout_ms",
    "max_heartbeat_interval": "max_heartbeat_interval_ms",
    "max_output_buffer_timeout": "max_output_buffer_timeout_ms",
    "min_output_buffer_timeout": "min_output_buffer_timeout_ms",
    "retention_max_age": "retention_max_age_ms",
    "retention_min_age": "retention_min_age_ms",
    "delay_threshold": "delay_threshold_ms",
    "retention_check_interval": "retention_check_interval_ms",
    "checkpoint_interval": "checkpoint_interval_ms",
    "half_check_timeout": "half_check_timeout_ms",
    "etcd_lease_ttl": "etcd_lease_ttl_ms",
    "repl_timeout": "repl_timeout_ms",
    "commit_timeout": "commit_timeout_ms",
    "trace_retention_max_age": "trace_retention_max_age_ms",
}
_LISTS = {"lookupd_tcp_address", "auth_http_address"}
_BOOLS = {"snappy", "deflate", "http_legacy_envelope", "disable_auto_create",
          "test_ack_before_sync", "trace_all", "journal"}
# Classic config-file keys that name one of our options differently.
_CONFIG_ALIASES = {"nsqlookupd_tcp_addresses": "lookupd_tcp_address",
                   "auth_http_addresses": "auth_http_address"}
# Options the node cannot honour: refused with this reason when given a value.
_REFUSED: dict[str, str] = {}
TLS_VERSIONS = ("ssl3.0", "tls1.0", "tls1.1", "tls1.2", "tls1.3")

_HELP = {
    "tcp_address": "<addr>:<port> to listen on for TCP clients",
    "http_address": "<addr>:<port> to listen on for HTTP clients",
    "https_address": "<addr>:<port> to listen on for HTTPS clients (needs --tls-cert and "
                     "--tls-key)",
    "broadcast_address": "address this node is known by (default: the host name)",
    "broadcast_tcp_port": "TCP port this node is known by (0: the port it listens on)",
    "broadcast_http_port": "HTTP port this node is known by (0: the port it listens on)",
    "lookupd_tcp_address": "lookupd TCP address (may be given multiple times)",
    "etcd_endpoints": "etcd client URLs, comma-separated (http://127.0.0.1:2379): cluster "
                      "mode, topics and their leaders come from etcd",
    "cluster_id": "cluster id: the node's keys live under /nsq/<id>/ in etcd",
    "etcd_lease_ttl": "TTL of the node's etcd lease: a killed node leaves the cluster "
                      "this long after its last refresh (whole seconds, at least 1s)",
    "rpc_address": "<addr>:<port> of the replication port (cluster mode), registered "
                   "in etcd",
    "broadcast_rpc_port": "replication port this node is known by (0: the port of "
                          "--rpc-address; a proxy's port, as jepsen's loopback hosts use)",
    "repl_timeout": "a follower that does not acknowledge a push within this long leaves "
                    "the in-sync replica set (duration)",
    "commit_timeout": "a publish not acknowledged within this long is answered "
                      "E_FAILED_ON_NOT_WRITABLE (HTTP 503): one not written yet is dropped, one "
                      "written may still be delivered (duration)",
    "rack": "failure domain of this node (cluster mode): a partition's replicas go to "
            "distinct racks while there are racks; empty: the host of --broadcast-address "
            "(several nsqd on one host share it)",
    "default_partitions": "partitions of a topic auto-created in etcd by a PUB or SUB",
    "default_replicas": "replicas of a topic auto-created in etcd by a PUB or SUB",
    "data_path": "folder for topics, channels and their delay queues",
    "segment_bytes": "size of one data segment file (bytes)",
    "sync_every": "messages per fdatasync; 1 syncs every batch before its OK",
    "sync_timeout": "with --sync-every > 1, also sync data this old (duration)",
    "journal": "write every partition on one thread and sync the durable batches of a round "
               "together, one fdatasync of the node journal (false: a write thread a "
               "partition, each batch synced in its own write call; see diskqueue/README.md)",
    "journal_checkpoint_bytes": "once the node journal's file holds this much, a checkpoint "
                                "syncs the segments it covers, on a thread of its own, and "
                                "the next file begins (bytes; the journal's disk and a "
                                "restart's replay grow with it)",
    "test_ack_before_sync": "TEST ONLY, a deliberately broken build: answer a TCP publish "
                            "OK before its batch is written and synced (jepsen shows the "
                            "loss); never use it",
    "mem_queue_size": "accepted for compatibility and ignored: every message goes to disk "
                      "before its OK, and the page cache is the memory queue",
    "retention_max_age": "drop segments older than this even if a channel still needs them "
                         "(0: never)",
    "retention_max_bytes": "drop the oldest segments beyond this size per partition (0: never)",
    "trace_all": "record trace events of every topic and channel (else per topic or channel: "
                 "POST /message/trace/enable)",
    "trace_buffer": "trace events waiting for the store; beyond this they are dropped and counted",
    "trace_retention_max_age": "delete trace events older than this (0: never)",
    "trace_retention_max_bytes": "delete the oldest trace events beyond this size (0: never)",
    "trace_es_url": "store trace events in this Elasticsearch (http://host:9200) instead of "
                    "<data-path>/trace.sqlite; searches read it too",
    "trace_es_index_prefix": "names of the daily trace indices: <prefix>YYYY.MM.DD",
    "trace_es_ca_certs": "PEM file of the certificate authorities an https --trace-es-url is "
                         "checked against (default: the system's)",
    "trace_es_username": "Elasticsearch user (basic auth; the password in "
                         "--trace-es-password-file)",
    "trace_es_password_file": "file holding the Elasticsearch user's password",
    "trace_es_api_key_file": "file holding an Elasticsearch API key (the encoded form), "
                             "instead of a user and password",
    "retention_min_age": "keep a segment every channel has finished until its last message is "
                         "this old, for replay (0: drop it at the next check; a cluster "
                         "topic's own retention overrides it)",
    "checkpoint_interval": "how often channel cursors are saved (after a crash a channel "
                           "redelivers what was finished since)",
    "max_msg_size": "largest message body (bytes)",
    "max_body_size": "largest MPUB body (bytes)",
    "msg_timeout": "default time a client has to FIN, REQ or TOUCH a message",
    "max_msg_timeout": "longest msg_timeout a client may ask for, and TOUCH limit",
    "max_req_timeout": "longest REQ and DPUB delay (at most 168h)",
    "delay_threshold": "delays at least this long wait in the channel's disk delay queue",
    "delay_after_attempts": "a message delivered this many times waits on disk between tries",
    "half_check_timeout": "a half message neither committed nor rolled back this long is "
                          "checked back with its producer (then with backoff)",
    "half_check_max": "check-backs of a half message without a decision before it is "
                      "rolled back",
    "max_rdy_count": "largest RDY a client may send",
    "max_channel_window": "messages a channel may hold taken and not confirmed past",
    "disable_auto_create": "never make a topic on PUB, SUB or /pub (E_TOPIC_NOT_EXIST); "
                           "POST /topic/create still makes one",
    "tls_required": "require TLS for TCP clients: false, true or tcp-https; true with "
                    "--https-address also refuses HTTP calls but GETs on --http-address",
    "admin_secret_file": "file whose first line is the admin secret: every HTTP call but "
                         "GET, /pub, /mpub and /half* then needs 'Authorization: Bearer <secret>'",
    "tls_min_version": "oldest TLS version accepted: " + ", ".join(TLS_VERSIONS),
    "tls_client_auth_policy": "require (a client certificate) or require-verify (one "
                              "signed by --tls-root-ca-file)",
    "auth_http_address": "auth server <addr>:<port> (may be given several times)",
    "http_legacy_envelope": "answer HTTP requests without 'Accept: application/vnd.nsq; "
                            "version=1.0' in older nsqd's {status_code, status_txt, data} "
                            "envelope (v1.3.0 never does)",
    "log_level": "debug, info, warning or error",
    "log_format": "console or json",
}


def parse_tls_required(text: str | int | bool) -> int:
    """Classic --tls-required: false/0, true/1, or tcp-https (2)."""
    value = str(text).strip().lower()
    for level, names in enumerate((("false", "0", ""), ("true", "1"), ("tcp-https", "2"))):
        if value in names:
            return level
    raise ValueError(f"invalid --tls-required {text!r} (false, true or tcp-https)")


def _default_text(f: dataclasses.Field, name: str) -> str:
    """` (default ...)` as Go's flag package prints it: strings quoted, durations as
    time.Duration, nothing for a zero value (or one computed at start)."""
    from .stats import go_duration

    value = f.default
    if value is dataclasses.MISSING or not value:
        return ""
    if name in _DURATIONS:
        return f" (default {go_duration(value * 1_000_000)})"
    if isinstance(value, bool):
        return " (default true)"
    if isinstance(value, str):
        return f' (default "{value}")'
    return f" (default {value})"


def parser(version: str | None = None) -> argparse.ArgumentParser:
    """The flags; `version` is what `--version` prints (main.version_line)."""
    p = argparse.ArgumentParser(prog="nsqd", description="durable NSQ-compatible daemon",
                                argument_default=argparse.SUPPRESS, allow_abbrev=False)
    p.add_argument("--config", metavar="file",
                   help="TOML config file (flag names with underscores)")
    if version is not None:
        p.add_argument("--version", action="version", version=version,
                       help="print the version and exit")
    for f in dataclasses.fields(Options):
        name = f.name
        if name.endswith("_ms") and name[:-3] in _DURATIONS:
            name = name[:-3]
        flag = "--" + name.replace("_", "-")
        kw = {"dest": name, "help": (_HELP.get(name) or "") + _default_text(f, name)}
        if name in _LISTS:
            p.add_argument(flag, action="append", metavar="string", **kw)
        elif name in _BOOLS:
            p.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "yes"),
                           nargs="?", const=True, metavar="bool", **kw)
        elif name in _DURATIONS:
            p.add_argument(flag, type=parse_duration_ms, metavar="duration", **kw)
        elif name == "tls_required":
            p.add_argument(flag, type=parse_tls_required, nargs="?", const=1, metavar="value",
                           **kw)
        elif name == "tls_min_version":
            p.add_argument(flag, choices=TLS_VERSIONS, metavar="string", **kw)
        elif f.type in ("int", int):
            p.add_argument(flag, type=int, metavar="int", **kw)
        else:
            p.add_argument(flag, metavar="string", **kw)
    return p


_GO_FLAG = re.compile(r"--?([A-Za-z][A-Za-z0-9_-]*)(=.*)?", re.S)


def go_style(argv: list[str], p: argparse.ArgumentParser) -> list[str]:
    """`argv` with Go's spellings made argparse's: `-flag` is `--flag`, and a flag that
    needs a value takes the next argument whatever it looks like (`--flag=value`).
    What names no flag is left as it is, for argparse to refuse."""
    needs_value, known = set(), set()
    for action in p._actions:
        for option in action.option_strings:
            known.add(option)
            if action.nargs is None:
                needs_value.add(option)
    out = []
    args = iter(argv)
    for arg in args:
        m = _GO_FLAG.fullmatch(arg)
        flag = "--" + m.group(1) if m else None
        if flag not in known:
            out.append(arg)
        elif m.group(2) is not None:
            out.append(flag + m.group(2))
        elif flag in needs_value:
            value = next(args, None)
            out.append(flag if value is None else f"{flag}={value}")
        else:
            out.append(flag)
    return out


def from_args(argv: list[str] | None = None, version: str | None = None) -> Options:
    p = parser(version)
    args = vars(p.parse_args(go_style(sys.argv[1:] if argv is None else argv, p)))
    values: dict = {}
    config = args.pop("config", None)
    if config:
        try:
            with open(config, "rb") as f:
                loaded = tomllib.load(f)
        except OSError as e:
            raise ValueError(f"cannot read --config {config}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {config} is not valid TOML: {e}") from None
        for key, value in loaded.items():
            key = key.replace("-", "_")
            name = _CONFIG_ALIASES.get(key, key)
            if value and name in _REFUSED:
                raise ValueError(f"{key} in --config {config}: {_REFUSED[name]}")
            values[name] = value
    values.update(args)
    return build(values)


def build(values: dict) -> Options:
    """Options from flag-named values (durations converted, unknown names refused)."""
    known = {f.name for f in dataclasses.fields(Options)}
    kwargs = {}
    for key, value in values.items():
        if key in _DURATIONS:
            kwargs[_DURATIONS[key]] = parse_duration_ms(value)
        elif key == "tls_required":
            kwargs[key] = parse_tls_required(value)
        elif key in known:
            kwargs[key] = value
        else:
            raise ValueError(f"unknown option {key!r}")
    for key in _LISTS:
        if isinstance(kwargs.get(key), str):
            kwargs[key] = [kwargs[key]]
    for key, reason in _REFUSED.items():
        if kwargs.get(key):
            raise ValueError(f"--{key.replace('_', '-')}: {reason}")
    options = Options(**kwargs)
    for address in options.lookupd_tcp_address:
        lookupd_host_port(address)
    if options.etcd_endpoints:
        check_cluster_options(options)
    if options.tls_min_version not in TLS_VERSIONS:
        raise ValueError(f"--tls-min-version must be one of {', '.join(TLS_VERSIONS)}")
    if not 0 < options.max_req_timeout_ms <= MAX_DELAY_MS:
        raise ValueError("--max-req-timeout must be between 1ms and 7 days (168h)")
    if not 100 <= options.half_check_timeout_ms <= MAX_DELAY_MS:
        raise ValueError("--half-check-timeout must be between 100ms and 7 days (168h)")
    if not 1 <= options.half_check_max <= 1000:
        raise ValueError("--half-check-max must be 1..1000")
    if not 64 * 1024 <= options.journal_checkpoint_bytes <= 1 << 40:
        raise ValueError("--journal-checkpoint-bytes must be 64 KiB..1 TiB")
    if options.trace_es_url:
        url = urllib.parse.urlsplit(options.trace_es_url)
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme not in ("http", "https") or not url.hostname or port is None:
            raise ValueError("--trace-es-url must be http(s)://host:port")
    check_trace_es_auth(options)
    if options.https_address:
        if not (options.tls_cert and options.tls_key):
            raise ValueError("--https-address needs --tls-cert and --tls-key")
        try:
            port = options.https_host_port[1]
        except ValueError:
            port = -1
        if not 0 <= port < 65536:
            raise ValueError(f"invalid --https-address {options.https_address!r} "
                             "(want <addr>:<port>)")
    if options.admin_secret_file:
        adminkey.read_secret(options.admin_secret_file)
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", options.trace_es_index_prefix):
        raise ValueError("--trace-es-index-prefix: lowercase letters, digits, '.', '_', '-'")
    return options


def check_trace_es_auth(o: Options) -> None:
    """The Elasticsearch credentials: a user with a password file, or an API key file, or
    neither; every file named is readable (the node reads them when the store opens)."""
    if bool(o.trace_es_username) != bool(o.trace_es_password_file):
        raise ValueError("--trace-es-username and --trace-es-password-file go together")
    if o.trace_es_username and o.trace_es_api_key_file:
        raise ValueError("--trace-es-api-key-file or --trace-es-username, not both")
    named = (o.trace_es_ca_certs, o.trace_es_password_file, o.trace_es_api_key_file)
    if any(named) and not o.trace_es_url:
        raise ValueError("the --trace-es-* credentials need --trace-es-url")
    for path in named:
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"{path}: not a readable file")


def check_cluster_options(options: Options) -> None:
    """Cluster mode's flags: ValueError naming the first bad one."""
    if options.lookupd_tcp_address:
        raise ValueError("--etcd-endpoints (cluster mode) and --lookupd-tcp-address "
                         "(classic mode) cannot be used together")
    try:
        parse_endpoints(options.etcd_endpoints)
        check_cluster(options.cluster_id)
    except ValueError as e:
        raise ValueError(f"--etcd-endpoints/--cluster-id: {e}") from None
    if options.etcd_lease_ttl_ms < 1000:
        raise ValueError("--etcd-lease-ttl must be at least 1s")
    if not 10 <= options.repl_timeout_ms <= 60_000:
        raise ValueError("--repl-timeout must be 10ms..60s")
    if not 100 <= options.commit_timeout_ms <= 3_600_000:
        raise ValueError("--commit-timeout must be 100ms..1h")
    if len(options.rack) > 255:
        raise ValueError("--rack: at most 255 characters")
    try:
        host, port = _split(options.rpc_address)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ValueError(f"invalid --rpc-address {options.rpc_address!r} (want host:port)")
    if not 1 <= options.default_partitions <= MAX_PARTITIONS:
        raise ValueError(f"--default-partitions must be 1..{MAX_PARTITIONS}")
    if not 1 <= options.default_replicas <= MAX_REPLICAS:
        raise ValueError(f"--default-replicas must be 1..{MAX_REPLICAS}")


MAX_DELAY_MS = 7 * 24 * 3_600_000  # the longest delay the delay queue accepts
