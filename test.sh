#!/usr/bin/env bash
# Set up everything and run the whole test suite. Extra arguments go to pytest
# (for example --long for the long fault runs).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
# Two workers (pytest-xdist), each taking whole test modules (so every jepsen run, all in
# tests/test_jepsen.py, runs alone): most tests wait on real processes, so two workers
# share the 2-core CI machine well (tests/README.md).
exec .venv/bin/python -m pytest -n "${NSQ_TEST_WORKERS:-2}" --dist loadfile "$@"
