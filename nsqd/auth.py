"""AUTH against an auth HTTP server, as classic nsqd does (`--auth-http-address`).

The server is asked `GET /auth?remote_ip=&tls=&secret=` and answers
{"identity", "identity_url", "ttl", "authorizations": [{"topic", "channels",
"permissions"}]}; topic and channel patterns are regular expressions that
must match the whole name. Any failure to reach or parse it is a failed AUTH.
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
                    data = await resp.json(content_type=None)
                    return AuthResult(str(data.get("identity", "")),
                                      str(data.get("identity_url", "")),
                                      list(data.get("authorizations") or []),
                                      float(data.get("ttl") or 0))
            except (aiohttp.ClientError, TimeoutError, ValueError, TypeError) as e:
                log.warning("auth_server_failed", address=address, error=str(e))
    return None


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
