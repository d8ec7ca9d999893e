#!/usr/bin/env bash
# Set up what the project needs on a fresh Debian machine. Idempotent: a second run only
# checks.
#   scripts/setup.sh --run   what running needs (./run.sh): Python with venv, etcd, a
#                            virtualenv in .venv with the project, and the compiled hot
#                            path in build/mypyc (gcc)
#   scripts/setup.sh         that, plus the test tools (./test.sh): the test extra, node and
#                            the npm clients, FUSE, iptables, faketime, chromium, Java
# Debian packages come without recommended extras; apt-get waits for a dpkg lock another
# apt-get holds (up to 5 minutes) instead of failing.
set -euo pipefail
cd "$(dirname "$0")/.."
run_only=0
[ "${1:-}" = "--run" ] && run_only=1

need_apt=()
# Python 3.11+ with venv and ensurepip (Debian ships venv apart, in python3-venv).
python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || need_apt+=(python3 python3-venv)
# scripts/compile.py builds C extensions: gcc and the Python headers
command -v gcc >/dev/null || need_apt+=(gcc)
python3 -c 'import os, sysconfig; os.stat(sysconfig.get_paths()["include"] + "/Python.h")' \
  2>/dev/null || need_apt+=(python3-dev)
# cluster mode: the real etcd server, started by tests and the run command on loopback
command -v etcd >/dev/null || need_apt+=(etcd-server)
if [ "$run_only" = 0 ]; then
  command -v node >/dev/null || need_apt+=(nodejs)  # tests/compat runs nsqjs under node
  command -v npm >/dev/null || need_apt+=(npm)
  # tests/powerfs.py (power-loss tests): fusermount3 and libfuse3, used through mfusepy
  command -v fusermount3 >/dev/null || need_apt+=(fuse3)
  # jepsen/: partitions are iptables DROP rules inside network namespaces
  command -v iptables >/dev/null || need_apt+=(iptables)
  # libfaketime: jepsen's clock-skew nemesis runs one host's nsqd with its wall clock
  # skewed (LD_PRELOAD); the faketime package brings the library
  ls /usr/lib/*/faketime/libfaketimeMT.so.1 >/dev/null 2>&1 || need_apt+=(faketime)
  # tests/test_nsqadmin_browser.py: Playwright drives Debian's chromium (no playwright install)
  command -v chromium >/dev/null || need_apt+=(chromium)
  # spark/ (PySpark, installed by pip through the test extra) runs on a JVM: Java 17
  command -v java >/dev/null || need_apt+=(openjdk-17-jre-headless)
fi
if [ "${#need_apt[@]}" -gt 0 ]; then
  apt_get=(apt-get -qq -o DPkg::Lock::Timeout=300)
  "${apt_get[@]}" update
  DEBIAN_FRONTEND=noninteractive "${apt_get[@]}" install -y --no-install-recommends \
    "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# The compiled hot path (scripts/compile.py, mypyc, from the same .py files) goes to
# build/mypyc, rebuilt only when a compiled source changed; NSQ_PURE=1 at run time selects
# the .py modules instead. A build that fails leaves the .py modules to run, and says so
# (the test suite then fails in tests/test_compiled.py).
compile_hot_path() {
  .venv/bin/python scripts/compile.py >/dev/null || echo "setup: the compiled hot path" \
    "did not build: the .py modules run (.venv/bin/python scripts/compile.py says why)" >&2
}
if [ "$run_only" = 1 ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e '.[compile]'
  compile_hot_path
  exit 0
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,compile]'
compile_hot_path

# nsqjs for tests/compat (node_modules is not committed; package-lock.json is).
# npm ci only when the lock file changed since the last install.
js=tests/compat/js
if ! cmp -s "$js/package-lock.json" "$js/node_modules/.compat-lock-stamp" 2>/dev/null; then
  (cd "$js" && npm ci --no-audit --no-fund --loglevel=error)
  cp "$js/package-lock.json" "$js/node_modules/.compat-lock-stamp"
fi
