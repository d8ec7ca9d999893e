"""Where the compiled modules are taken from (scripts/compile.py, issue #31 item 2).

Each package with compiled modules calls `use_compiled(__path__, __name__)` in its
__init__: when build/mypyc/<package>/ exists and the manifest the build wrote still
matches every compiled source byte for byte, that folder goes first on the package's
__path__, so `import nsqwire.protocol` loads the extension module built from
nsqwire/protocol.py. Otherwise (no build, a source edited since, NSQ_PURE=1 in the
environment) nothing changes: the .py modules run. Imports nothing of ours.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build", "mypyc")
MANIFEST = os.path.join(BUILD, "manifest.json")
_fresh: bool | None = None


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _build_fresh() -> bool:
    """The build exists and every source it compiled is unchanged since."""
    try:
        with open(MANIFEST) as f:
            sources = json.load(f)["sources"]
        stale = [p for p, h in sources.items() if digest(os.path.join(ROOT, p)) != h]
    except (OSError, ValueError, KeyError):
        return False
    if stale:
        print(f"nsq: compiled modules ignored, sources changed since the build: "
              f"{', '.join(stale)} (scripts/compile.py)", file=sys.stderr)
        return False
    return True


def use_compiled(path: list[str], package: str) -> None:
    global _fresh
    if os.environ.get("NSQ_PURE"):
        return
    folder = os.path.join(BUILD, *package.split("."))
    if not os.path.isdir(folder):
        return
    if _fresh is None:
        _fresh = _build_fresh()
    if not _fresh:
        return
    if BUILD not in sys.path:
        sys.path.append(BUILD)  # the group's shared library (nsq_hot__mypyc), no package
    path.insert(0, folder)
