"""AUTH against an auth HTTP server, as classic nsqd does (`--auth-http-address`).

The server is asked `GET /auth?remote_ip=&tls=&secret=` and answers
{"identity", "identity_url", "ttl", "authorizations": [{"topic", "channels",
"permissions"}]}; topic and channel patterns are regular expressions that
must match the whole name. Any failure to reach or parse it is a failed AUTH
(E_AUTH_FAILED, one log line): as classic nsqd decodes the answer into typed
fields, a field of another type (`authorizations` as a string, a `ttl` that is
not an integer, ...) fails the whole answer; a missing or null field is empty.
As in classic nsqd, the answer holds for `ttl` seconds; the first check after
that asks the server again with the same secret.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import aiohttp
import structlog

log = structlog.get_logger("nsqd.auth")


@dataclass
class AuthResult:
    identity: str
    identity_url: str
    authorizations: list[dict]
    ttl_s: float


async def authenticate(addresses: list[str], remote_ip: str, tls: bool,
                       secret: bytes) -> AuthResult | None:
    params = {"remote_ip": remote_ip, "tls": "true" if tls else "false",
              "secret": secret.decode("utf-8", "replace")}
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for address in addresses:
            url = address if "://" in address else f"http://{address}"
            try:
                async with session.get(f"{url}/auth", params=params) as resp:
                    if resp.status != 200:
                        continue
                    return parse_answer(await resp.json(content_type=None))
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                log.warning("auth_server_failed", address=address, error=str(e))
    return None


def parse_answer(data) -> AuthResult:
    """The auth server's JSON answer, or ValueError naming what has the wrong shape."""
    if not isinstance(data, dict):
        raise ValueError("the answer is not a JSON object")
    authorizations = []
    for a in _field(data, "authorizations", list, []):
        if a is None:
            continue
        if not isinstance(a, dict):
            raise ValueError("an authorization is not a JSON object")
        topic = _field(a, "topic", str, "")
        channels = _field(a, "channels", list, [])
        permissions = _field(a, "permissions", list, [])
        if not all(isinstance(v, str) for v in channels + permissions):
            raise ValueError("channels and permissions must be lists of strings")
        authorizations.append({"topic": topic, "channels": channels,
                               "permissions": permissions})
    return AuthResult(_field(data, "identity", str, ""), _field(data, "identity_url", str, ""),
                      authorizations, _field(data, "ttl", int, 0))


def _field(data: dict, name: str, kind: type, empty):
    value = data.get(name)
    if value is None:
        return empty
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{name!r} must be {kind.__name__}, not {type(value).__name__}")
    return value


def allowed(authorizations: list[dict], topic: str, channel: str, permission: str) -> bool:
    for a in authorizations:
        if permission not in a.get("permissions", []):
            continue
        if not _matches(a.get("topic", ""), topic):
            continue
        if not channel or any(_matches(c, channel) for c in a.get("channels", [])):
            return True
    return False


def _matches(pattern: str, name: str) -> bool:
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False
