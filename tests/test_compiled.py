"""The compiled hot path (scripts/compile.py): which modules run, in the tests and in nsqd.

./test.sh runs the whole suite on the compiled build, then the protocol and storage unit
tests again with NSQ_PURE=1. These tests make sure each run is the one it says it is: a
build that silently fell back to the .py files would make the first run a second pure one.
"""

import json
import os
import subprocess
import sys

import pytest

from nsqwire import _compiled

sys.path.insert(0, _compiled.ROOT)
from scripts.compile import MODULES  # noqa: E402

PURE = bool(os.environ.get("NSQ_PURE"))


def module_files(env):
    """Each compiled module's file, as a fresh interpreter with `env` imports it."""
    names = [m[:-3].replace("/", ".") for m in MODULES]
    code = ("import importlib, json, sys; "
            f"print(json.dumps([importlib.import_module(n).__file__ for n in {names!r}]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=_compiled.ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    return dict(zip(MODULES, json.loads(out.stdout)))


@pytest.mark.skipif(PURE, reason="the pure run (NSQ_PURE=1)")
def test_the_suite_runs_every_hot_module_compiled():
    env = dict(os.environ)
    env.pop("NSQ_PURE", None)
    for source, path in module_files(env).items():
        assert path.startswith(_compiled.BUILD) and path.endswith(".so"), (
            f"{source} runs from {path}: build it with scripts/setup.sh")


def test_nsq_pure_runs_the_py_files():
    env = dict(os.environ, NSQ_PURE="1")
    for source, path in module_files(env).items():
        assert path == os.path.join(_compiled.ROOT, source)


def test_a_source_changed_since_the_build_is_not_run_compiled(tmp_path, monkeypatch):
    """A manifest whose digest differs from a source is stale: the .py files run."""
    with open(_compiled.MANIFEST) as f:
        sources = json.load(f)["sources"]
    assert set(sources) == set(MODULES)
    monkeypatch.setattr(_compiled, "MANIFEST", str(tmp_path / "manifest.json"))
    (tmp_path / "manifest.json").write_text(json.dumps({"sources": sources}))
    assert _compiled._build_fresh()
    sources[MODULES[0]] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps({"sources": sources}))
    assert not _compiled._build_fresh()
    path = []
    monkeypatch.setattr(_compiled, "_fresh", None)
    _compiled.use_compiled(path, "nsqwire")
    assert path == []
