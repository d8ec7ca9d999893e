"""Compile the per-message modules with mypyc, from their own .py files (issue #31, item 2).

    .venv/bin/python scripts/compile.py [--clean] [MODULE.py ...]

Without --clean, a build whose manifest names the same modules with the same source
bytes, built for this interpreter (its extension suffix), is kept (scripts/setup.sh runs
this on every ./test.sh and ./run.sh). One build at a time (a lock on build/compile.lock):
two setups at once never write the same files.

The extension modules go to build/mypyc/ (a tree of packages holding only .so files);
each compiled package's __init__ puts its folder there first on its __path__
(nsqwire/_compiled.py), so `import nsqwire.protocol` takes the compiled module and every
other module stays the .py. NSQ_PURE=1 in the environment selects the pure modules: the
compiled ones are never looked at. The sources are unchanged by the build: one source
for every rule.

What a compiled module asks of its source (each was a TypeError or an import error here):
- an annotation is checked at run time: `feed(data: bytes)` refuses a bytearray; a loop
  handle typed asyncio.Handle refuses uvloop's (no subclass); typeshed's Server.sockets is
  a tuple, uvloop's a list. Duck-typed things are `Any`.
- an attribute assigned only None (or only one class) in __init__ is typed that: set to a
  Tracer, or to replication's writer, it raises. Type such attributes where they are made.
- a class body holds annotated assignments and methods only: no `A, B = range(2)`, no table
  of its own methods (they are module tables after the class).
- a compiled class takes no new attribute at run time, and a method patched on it is not
  what compiled callers call: the classes tests patch (Client) stay Python, and tests of
  the partition's log hook the `os` calls its files go through (tests/fdhooks.py);
- a native class has one base class: DiskQueue's parts are one chain, not mixins
  (diskqueue/state.py), each declaring its fields; and a Python function called from
  compiled code returns what it is typed to (a patched `-> None` returning a tuple raises).
- `int` parameters are unboxed and boxed again for every C call they go to: a function
  that only hands them on to struct.pack runs slower compiled (entry.encode_fields takes
  `object`); locals read from a C call (`size: int = unpack(...)[0]`) gain from a type.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "build", "mypyc")
TMP = os.path.join(ROOT, "build", "mypyc-tmp")

# The modules a durable PUB runs per message (bench/pubpath.py under py-spy: their own
# Python time, most first), the partition's log: DiskQueue's chain of classes
# (diskqueue/state.py), compiled together as native classes, and what the node's write
# thread runs a batch: its segment and commitlog writes, and the journal.
MODULES = [
    "nsqd/tcp.py",
    "nsqwire/protocol.py",
    "nsqd/topic.py",
    "commitlog/entry.py",
    "diskqueue/record.py",
    "diskqueue/state.py",
    "diskqueue/groupcommit.py",
    "diskqueue/replicated.py",
    "diskqueue/queue.py",
    "diskqueue/segments.py",
    "commitlog/log.py",
    "diskqueue/journal.py",
]

MYPY_ARGS = ["--follow-imports=silent", "--ignore-missing-imports", "--python-version=3.11",
             # an Optional attribute set once connected (ClientConnection.client): the
             # compiled access checks it at run time, as Python does
             "--disable-error-code=union-attr"]


def main(argv: list[str]) -> int:
    os.makedirs(os.path.join(ROOT, "build"), exist_ok=True)
    with open(os.path.join(ROOT, "build", "compile.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build(argv)


def build(argv: list[str]) -> int:
    if argv[:1] == ["--clean"]:
        shutil.rmtree(OUT, ignore_errors=True)
        shutil.rmtree(TMP, ignore_errors=True)
        argv = argv[1:]
    modules = argv or MODULES
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    from mypyc.build import mypycify
    from setuptools import setup

    from nsqwire._compiled import MANIFEST, digest

    manifest = {"sources": {m: digest(os.path.join(ROOT, m)) for m in modules},
                "abi": sysconfig.get_config_var("EXT_SUFFIX")}
    try:
        with open(MANIFEST) as f:
            if json.load(f) == manifest:
                print(f"compiled modules up to date in {os.path.relpath(OUT, ROOT)}")
                return 0
    except (OSError, ValueError):
        pass
    ext_modules = mypycify(MYPY_ARGS + modules, opt_level="3", debug_level="0",
                           target_dir=TMP, group_name="nsq_hot")
    shutil.rmtree(OUT, ignore_errors=True)
    setup(name="nsq-compiled", ext_modules=ext_modules, script_args=[
        "build_ext", "--build-lib", OUT, "--build-temp", os.path.join(TMP, "obj"), "-q"])
    with open(MANIFEST, "w") as f:  # last: the build is whole once it names its sources
        json.dump(manifest, f, indent=1)
    print(f"compiled {len(modules)} modules into {os.path.relpath(OUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
