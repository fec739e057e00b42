#!/usr/bin/env bash
# The outbox-relay benchmark, one command:
#
#   bench/run.sh                  the full run (about 25 minutes on 2 cores)
#   BENCH_QUICK=1 bench/run.sh    a smoke run of about 2 minutes, small sizes
#   bench/run.sh --soak           the soak run instead (bench/soak.py): 30 minutes
#                                 of steady load, storage and latency against time
#
# Installs what is missing (scripts/deps.sh demo, plus gnuplot-nox for the plots and
# PgQ, postgresql-<major>-pgq3, for the side-by-side section),
# builds the relay optimised (CMake Release) into build-bench with the two
# benchmark tools (bench/loadgen.c, bench/pgq.c) beside it, then runs
# bench/bench.py (as the module bench.bench, with the repository root on
# PYTHONPATH, where it finds the packages bench and testkit): it starts its own
# PostgreSQL and Redis on loopback, prints the table, and writes
# bench/results/latest.csv, latest-table.md and PNG plots. Sizes and sections
# come from BENCH_* variables: see bench/bench.py, bench/benchlib.py and
# docs/PERFORMANCE.md.
set -euo pipefail

cd "$(dirname "$0")/.."
root=$(pwd)
build=${BENCH_BUILD_DIR:-$root/build-bench}
started=$(date +%s)

# --- dependencies -----------------------------------------------------------
scripts/deps.sh demo
# PgQ for the PostgreSQL the harness runs, the newest installed (testkit/postgres.py):
# 15 on Debian 12, 17 on Debian 13.
pg=
for d in /usr/lib/postgresql/*/bin/initdb; do
  v=${d#/usr/lib/postgresql/}
  v=${v%%/*}
  if [[ "$v" =~ ^[0-9]+$ ]] && ((v > ${pg:-0})); then
    pg=$v
  fi
done
if [[ -z "$pg" ]]; then
  echo "run.sh: PostgreSQL server binaries not found under /usr/lib/postgresql" >&2
  exit 1
fi
extra=(gnuplot-nox "postgresql-$pg-pgq3")
missing=()
for p in "${extra[@]}"; do
  [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" == "install ok installed" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
  if ((EUID != 0)); then
    echo "run.sh: missing Debian packages: ${missing[*]}; run as root or: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
  echo "run.sh: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" ||
    { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
fi
if ! command -v perf >/dev/null 2>&1; then
  echo "run.sh: perf not found (Debian package linux-perf): the profile section is skipped" >&2
fi

# --- build --------------------------------------------------------------------
# The load generator and the PgQ consumer (bench-loadgen, bench-pgq); CMake
# builds them (RELAY_BENCH) with the Release flags, -O3 -DNDEBUG, like the relay.
# bench-cursor, the snapshot-and-cursor prototype, is for bench/extra/snapshot_cursor.py.
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DRELAY_TESTS=OFF -DRELAY_BENCH=ON >/dev/null
cmake --build "$build" -j2 --target outbox-relay outbox_consumer bench-loadgen bench-pgq \
  bench-cursor

# --- run ----------------------------------------------------------------------
status=0
if [[ "${1:-}" == "--soak" ]]; then
  PYTHONPATH="$root" BENCH_BUILD_DIR="$build" /usr/bin/python3 -m bench.soak || status=$?
  echo "bench/run.sh --soak: $(($(date +%s) - started))s in all"
  exit "$status"
fi
PYTHONPATH="$root" BENCH_BUILD_DIR="$build" /usr/bin/python3 -m bench.bench || status=$?
took=$(($(date +%s) - started))
echo "bench/run.sh: ${took}s in all (installing, building and measuring)"
csv=${BENCH_RESULTS:-$root/bench/results}/latest.csv
if [[ -f "$csv" && $(stat -c %Y "$csv") -ge $started ]]; then
  printf 'timing,run.sh.seconds,%s,s,"bench/run.sh from start to end, build included"\n' "$took" \
    >>"$csv"
fi
exit "$status"
