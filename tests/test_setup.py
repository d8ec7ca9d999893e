"""scripts/setup.sh on a machine that lacks the Debian packages: what it asks apt-get and pip
for, run for ./run.sh (`--run`: what running needs) and for ./test.sh (everything), in a
copy of the repository's skeleton with apt-get, pip, npm and the virtualenv's python (which
runs scripts/compile.py) replaced by recorders (the real ones would install and build). The
PATH holds only the tools the script needs, so every package looks missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("bash", "dirname", "cmp", "cp", "ls", "mkdir")
TEST_ONLY = {"nodejs", "npm", "fuse3", "iptables", "chromium", "openjdk-17-jre-headless"}


def recorder(path: str, log: str, then: str = "") -> None:
    with open(path, "w") as f:
        f.write(f'#!/bin/bash\necho "${{0##*/}} $*" >> {log}\n{then}\n')
    os.chmod(path, 0o755)


def run_setup(tmp_path, *args: str) -> list[str]:
    """Run a copy of setup.sh with `args`; the commands it ran, one line each."""
    repo, bin_dir, log = tmp_path / "repo", tmp_path / "bin", tmp_path / "calls"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), repo / "scripts" / "setup.sh")
    (repo / ".venv" / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    recorder(str(bin_dir / "apt-get"), str(log))
    recorder(str(bin_dir / "npm"), str(log), then="mkdir -p node_modules")
    recorder(str(repo / ".venv" / "bin" / "pip"), str(log))
    recorder(str(repo / ".venv" / "bin" / "python"), str(log))  # scripts/compile.py's mypyc
    os.symlink(sys.executable, bin_dir / "python3")
    for tool in TOOLS:
        os.symlink(shutil.which(tool), bin_dir / tool)
    js = repo / "tests" / "compat" / "js"
    js.mkdir(parents=True)
    (js / "package-lock.json").write_text("{}")
    log.write_text("")
    subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), *args], check=True,
                   env={"PATH": str(bin_dir), "HOME": str(tmp_path)}, timeout=60)
    return log.read_text().splitlines()


def installed(calls: list[str]) -> set[str]:
    [line] = [c for c in calls if c.startswith("apt-get") and " install " in c]
    assert "-o DPkg::Lock::Timeout=300" in line  # waits for another apt-get's lock
    assert "--no-install-recommends" in line and " -qq " in line
    return set(line.split("--no-install-recommends", 1)[1].split())


def test_the_run_command_installs_only_what_running_needs(tmp_path):
    calls = run_setup(tmp_path, "--run")
    assert calls[0].startswith("apt-get -qq -o DPkg::Lock::Timeout=300 update")
    packages = installed(calls)
    assert {"etcd-server", "gcc"} <= packages and not packages & TEST_ONLY, packages
    assert calls[-2:] == ["pip install -q --disable-pip-version-check -e .[compile]",
                          "python scripts/compile.py"]
    assert not [c for c in calls if c.startswith("npm")]


def test_the_test_command_installs_the_test_tools_too(tmp_path):
    calls = run_setup(tmp_path)
    packages = installed(calls)
    assert {"etcd-server", *TEST_ONLY} - {"npm"} <= packages, packages  # npm: the recorder
    assert "pip install -q --disable-pip-version-check -e .[test,compile]" in calls
    assert "python scripts/compile.py" in calls
    assert any(c.startswith("npm ci") for c in calls)
