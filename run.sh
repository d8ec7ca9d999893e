#!/usr/bin/env bash
# Set up everything and start the system doing its main job: one durable nsqd on the
# classic ports (TCP 4150, HTTP 4151), data in ./data. Extra arguments go to nsqd.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
mkdir -p data
cat <<TXT
nsqd starting:
  TCP  127.0.0.1:4150   (any NSQ client: pynsq, go-nsq, nsqjs, ...)
  HTTP http://127.0.0.1:4151/stats?format=json  /ping  /metrics
  publish: curl -d 'hello' 'http://127.0.0.1:4151/pub?topic=test'
  data:    $(pwd)/data   (every acknowledged message is synced to disk)
Stop with Ctrl-C (drains, persists cursors, exits 0).
TXT
exec .venv/bin/nsqd --data-path ./data "$@"
