#!/usr/bin/env bash
# Set up everything and run the whole test suite, on the compiled hot path that
# scripts/setup.sh builds (tests/test_compiled.py checks that it runs), then the protocol
# and storage unit tests again on the pure .py modules (NSQ_PURE=1). Extra arguments go to
# the first pytest run (for example --long for the long fault runs).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
# Two workers (pytest-xdist), each taking whole test modules (so every jepsen run, all in
# tests/test_jepsen.py, runs alone): most tests wait on real processes, so two workers
# share the 2-core CI machine well (tests/README.md).
workers=(-n "${NSQ_TEST_WORKERS:-2}" --dist loadfile)
.venv/bin/python -m pytest "${workers[@]}" "$@"
NSQ_PURE=1 exec .venv/bin/python -m pytest "${workers[@]}" tests/test_compiled.py \
  tests/test_protocol.py tests/test_record.py tests/test_commitlog.py \
  tests/test_diskqueue.py tests/test_journal.py tests/test_tcp_fuzz.py tests/test_partitions.py
