"""IDENTIFY negotiation, sans-I/O: a JSON body and the server's limits in,
the client's settings and the reply bytes out.

Follows nsqd v1.3.0: the body is decoded the way Go's encoding/json fills
nsqd's identifyDataV2 (keys matched case-insensitively, unknown keys and nulls
ignored, a wrongly typed value fails the whole body), then each setting is
range-checked in nsqd's order. Errors are fatal, texts come from errors.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from nsqwire.errors import compression_conflict, identify_bad_json, identify_rejected
from nsqwire.protocol import decode_json

from .tags import ExtFilter, check_tag, compile_filter


@dataclass(frozen=True, slots=True)
class IdentifyLimits:
    """What the server allows and offers. Defaults are nsqd v1.3.0's; times in ms.

    tls/snappy/deflate_available: set only when the connection layer implements
    that upgrade (nsqd enables snappy and deflate by default).
    """
    max_rdy_count: int = 2500
    version: str = "1.3.0"
    heartbeat_interval_ms: int = 30_000
    max_heartbeat_interval_ms: int = 60_000
    output_buffer_size: int = 16 * 1024
    max_output_buffer_size: int = 64 * 1024
    output_buffer_timeout_ms: int = 250
    min_output_buffer_timeout_ms: int = 25
    max_output_buffer_timeout_ms: int = 30_000
    msg_timeout_ms: int = 60_000
    max_msg_timeout_ms: int = 900_000
    max_deflate_level: int = 6
    tls_available: bool = False
    snappy_available: bool = False
    deflate_available: bool = False
    auth_required: bool = False


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """A client's negotiated settings.

    heartbeat_interval_ms is -1 when heartbeats are off; output_buffer_timeout_ms
    is 0 when every write is flushed at once (output_buffer_size is then 1).
    tls_v1, snappy and deflate are the upgrades the server must perform now,
    in that order, each confirmed by one more OK frame on the upgraded stream.
    """
    client_id: str
    hostname: str
    user_agent: str
    heartbeat_interval_ms: int
    output_buffer_size: int
    output_buffer_timeout_ms: int
    msg_timeout_ms: int
    sample_rate: int
    tls_v1: bool
    snappy: bool
    deflate: bool
    deflate_level: int
    feature_negotiation: bool
    extend_support: bool
    desired_tag: str = ""  # tags.py: takes only messages with this tag ("" none)
    ext_filter: ExtFilter | None = None  # tags.py: messages it refuses are auto-finished


def initial_settings(limits: IdentifyLimits, client_id: str = "", hostname: str = "") -> ClientSettings:
    """A connection's settings before any IDENTIFY (nsqd uses the peer's host for both names)."""
    return ClientSettings(
        client_id=client_id, hostname=hostname, user_agent="",
        heartbeat_interval_ms=limits.heartbeat_interval_ms,
        output_buffer_size=limits.output_buffer_size,
        output_buffer_timeout_ms=limits.output_buffer_timeout_ms,
        msg_timeout_ms=limits.msg_timeout_ms,
        sample_rate=0, tls_v1=False, snappy=False, deflate=False,
        deflate_level=min(6, limits.max_deflate_level),
        feature_negotiation=False, extend_support=False)


_INT64 = (-(1 << 63), (1 << 63) - 1)
_INT32 = (-(1 << 31), (1 << 31) - 1)
# Field -> Go type, as in nsqd's identifyDataV2 (plus the fork's extend_support).
_FIELDS: dict[str, type | tuple[int, int]] = {
    "client_id": str, "hostname": str, "user_agent": str,
    "heartbeat_interval": _INT64, "output_buffer_size": _INT64, "output_buffer_timeout": _INT64,
    "deflate_level": _INT64, "msg_timeout": _INT64, "sample_rate": _INT32,
    "feature_negotiation": bool, "tls_v1": bool, "snappy": bool, "deflate": bool, "extend_support": bool,
    "desired_tag": str, "ext_filter": dict,  # Youzan's tag dispatch and filters (tags.py)
}


def _fields(body: bytes) -> dict:
    """The known, non-null fields of the body, type-checked as Go would."""
    try:
        data = decode_json(body)
    except ValueError:
        raise identify_bad_json() from None
    if data is None:  # Go decodes null into an untouched struct
        return {}
    if not isinstance(data, dict):
        raise identify_bad_json()
    fields = {}
    for key, value in data.items():
        key = key.casefold()
        kind = _FIELDS.get(key)
        if kind is None or value is None:
            continue
        if isinstance(kind, tuple):
            ok = type(value) is int and kind[0] <= value <= kind[1]
        else:
            ok = type(value) is kind
        if not ok:
            raise identify_bad_json()
        fields[key] = value
    return fields


def negotiate(body: bytes, limits: IdentifyLimits,
              current: ClientSettings | None = None) -> tuple[ClientSettings, bytes]:
    """Apply an IDENTIFY body to `current` (initial_settings when None).

    Returns the new settings and the response data: b"OK", or the negotiation
    JSON when the client asked for feature_negotiation. A zero or absent
    numeric setting keeps the current value; names are always replaced.
    Raises ProtocolError (fatal) exactly where nsqd does.
    """
    if current is None:
        current = initial_settings(limits)
    f = _fields(body)

    heartbeat = f.get("heartbeat_interval", 0)
    if heartbeat == 0:
        heartbeat = current.heartbeat_interval_ms
    elif heartbeat != -1 and not 1000 <= heartbeat <= limits.max_heartbeat_interval_ms:
        raise identify_rejected(f"heartbeat interval ({heartbeat}) is invalid")

    timeout = f.get("output_buffer_timeout", 0)
    if timeout == -1:
        timeout = 0
    elif timeout == 0:
        timeout = current.output_buffer_timeout_ms
    elif not limits.min_output_buffer_timeout_ms <= timeout <= limits.max_output_buffer_timeout_ms:
        raise identify_rejected(f"output buffer timeout ({timeout}) is invalid")

    size = f.get("output_buffer_size", 0)
    if size == -1:
        size, timeout = 1, 0
    elif size == 0:
        size = current.output_buffer_size
    elif not 64 <= size <= limits.max_output_buffer_size:
        raise identify_rejected(f"output buffer size ({size}) is invalid")

    sample_rate = f.get("sample_rate", 0)
    if not 0 <= sample_rate <= 99:
        raise identify_rejected(f"sample rate ({sample_rate}) is invalid")

    msg_timeout = f.get("msg_timeout", 0)
    if msg_timeout == 0:
        msg_timeout = current.msg_timeout_ms
    elif not 1000 <= msg_timeout <= limits.max_msg_timeout_ms:
        raise identify_rejected(f"msg timeout ({msg_timeout}) is invalid")

    negotiating = f.get("feature_negotiation", False)
    tls_v1 = negotiating and limits.tls_available and f.get("tls_v1", False)
    snappy = negotiating and limits.snappy_available and f.get("snappy", False)
    deflate = negotiating and limits.deflate_available and f.get("deflate", False)
    requested_level = f.get("deflate_level", 0)
    deflate_level = min(requested_level if deflate and requested_level > 0 else 6, limits.max_deflate_level)
    if deflate and snappy:
        raise compression_conflict()
    try:
        desired_tag = check_tag(f.get("desired_tag", current.desired_tag))
    except ValueError as e:
        raise identify_rejected(str(e)) from None
    try:
        ext_filter = compile_filter(f["ext_filter"]) if "ext_filter" in f else current.ext_filter
    except ValueError as e:
        raise identify_rejected(f"invalid ext_filter: {e}") from None

    settings = replace(
        current,
        client_id=f.get("client_id", ""), hostname=f.get("hostname", ""), user_agent=f.get("user_agent", ""),
        heartbeat_interval_ms=heartbeat, output_buffer_size=size, output_buffer_timeout_ms=timeout,
        msg_timeout_ms=msg_timeout, sample_rate=sample_rate,
        tls_v1=tls_v1, snappy=snappy, deflate=deflate, deflate_level=deflate_level,
        feature_negotiation=negotiating,
        extend_support=current.extend_support or f.get("extend_support", False),
        desired_tag=desired_tag, ext_filter=ext_filter)
    if not negotiating:
        return settings, b"OK"
    reply = {  # nsqd's key order
        "max_rdy_count": limits.max_rdy_count,
        "version": limits.version,
        "max_msg_timeout": limits.max_msg_timeout_ms,
        "msg_timeout": msg_timeout,
        "tls_v1": tls_v1,
        "deflate": deflate,
        "deflate_level": deflate_level,
        "max_deflate_level": limits.max_deflate_level,
        "snappy": snappy,
        "sample_rate": sample_rate,
        "auth_required": limits.auth_required,
        "output_buffer_size": size,
        "output_buffer_timeout": timeout,
    }
    if desired_tag:  # Youzan's reply names it (omitempty)
        reply["desired_tag"] = desired_tag
    return settings, json.dumps(reply, separators=(",", ":")).encode()
