#!/usr/bin/env bash
# Set up everything and run the whole test suite. Extra arguments go to pytest
# (for example --long for the long fault runs).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
