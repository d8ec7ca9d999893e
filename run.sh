#!/usr/bin/env bash
# Set up everything and start the system doing its main job: a local cluster on loopback
# (one etcd, two nsqlookupd, three nsqd in cluster mode, nsqadmin), every process's data under
# ./data, so a restart keeps the cluster. It prints where to look and what to try;
# Ctrl-C stops everything. Extra arguments go to scripts/localcluster.py (--help).
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh --run
exec .venv/bin/python scripts/localcluster.py --data ./data "$@"
