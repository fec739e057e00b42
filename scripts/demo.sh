#!/usr/bin/env bash
# The demo of the README's quick start: installs what is missing, builds the
# relay and the example consumer, and runs scripts/demo.py (an order service,
# the relay and an e-mail consumer group of two outbox-email-consumer processes
# against throwaway servers that are removed at the end, also on Ctrl-C).
# Extra arguments go to demo.py, e.g. --seconds 20 --rate 500 --fail-rate 0.2.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash scripts/deps.sh demo
build_dir="${BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build_dir" -j2 --target outbox-relay outbox-email-consumer >/dev/null

export OUTBOX_RELAY_BIN="$root/$build_dir/outbox-relay"
export OUTBOX_EMAIL_CONSUMER_BIN="$root/$build_dir/outbox-email-consumer"
export OUTBOX_RELAY_SOURCE_DIR="$root"
export PYTHONPATH="$root"  # the harness, testkit/
exec /usr/bin/python3 scripts/demo.py "$@"
