"""The admin key: one secret, read from a file (`--admin-secret-file`, so it never shows in
`ps`), that HTTP calls changing state on nsqd and nsqlookupd carry as
`Authorization: Bearer <secret>`. nsqadmin, and nsqlookupd calling nsqd, send it.

Invariants:
- Without a secret (the flag not given) nothing is checked: every call as classic.
- With one, a call that needs it is answered before its handler runs, so a refused call
  changes nothing: 401 `ADMIN_KEY_REQUIRED` when no Bearer key is sent, 403
  `ADMIN_KEY_INVALID` when it differs. The comparison is hmac.compare_digest: its time
  does not tell how much of a guess matched.
- A GET never needs the key (reads stay open); any other method does, unless the daemon
  lists the path among its `open_writes` (nsqd: /pub, /mpub and /half*, which are data).
- The file is read once, at start: a new secret takes a restart.
"""

from __future__ import annotations

import hmac

HEADER = "Authorization"
SCHEME = "Bearer "
REQUIRED = (401, "ADMIN_KEY_REQUIRED")
INVALID = (403, "ADMIN_KEY_INVALID")


def read_secret(path: str) -> str:
    """The secret: the file's first line without surrounding blanks. ValueError when the
    file cannot be read, or the secret is empty or not visible ASCII (a header carries it)."""
    try:
        with open(path, encoding="ascii", errors="strict") as f:
            secret = f.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --admin-secret-file {path}: "
                         f"{getattr(e, 'strerror', None) or 'not ASCII'}") from None
    if not secret or not all("!" <= c <= "~" for c in secret):
        raise ValueError(f"--admin-secret-file {path}: the first line must be the secret "
                         "(visible ASCII, no spaces)")
    return secret


def headers(secret: str) -> dict[str, str]:
    """What a caller sends: the key's header, or nothing without a secret."""
    return {HEADER: SCHEME + secret} if secret else {}


def refusal(secret: str, method: str, path: str, sent: str | None,
            open_writes: frozenset[str] = frozenset()) -> tuple[int, str] | None:
    """(status, code) refusing the call, or None to take it; `sent` is the request's
    Authorization header (None when absent)."""
    if not secret or method == "GET" or path in open_writes:
        return None
    if sent is None or not sent.startswith(SCHEME):
        return REQUIRED
    if not hmac.compare_digest(sent[len(SCHEME):].encode("utf-8", "replace"),
                               secret.encode("ascii")):
        return INVALID
    return None
