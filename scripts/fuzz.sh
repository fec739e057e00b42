#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang in build-fuzz and
# runs each for the given time, one after the other, from its seed corpus.
# First every input under tests/fuzz/regressions/<target>/ (inputs that once
# crashed a target) runs once: each must pass. Prints each target's final
# libFuzzer stats; exits non-zero when any target crashed, leaked or broke
# one of its checks. A crash leaves its input in build-fuzz/artifacts/.
#
# Usage: scripts/fuzz.sh [seconds per target]   (default 20)
#
# Environment:
#   FUZZ_BUILD_DIR  build directory (default build-fuzz)
#   FUZZ_TARGETS    the targets to run, space separated (default: all)
#   FUZZ_JOBS       how many targets run at once (default 1)
#
# New inputs that reach new code are kept in build-fuzz/corpus/<target>/,
# not in the seed corpus. To keep those that add coverage after a longer run:
#   build-fuzz/tests/fuzz/fuzz_<target> -merge=1 tests/fuzz/corpus/<target> \
#     build-fuzz/corpus/<target>
set -euo pipefail

seconds="${1:-20}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "usage: scripts/fuzz.sh [seconds per target]" >&2
  exit 64
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash scripts/deps.sh test

build_dir="${FUZZ_BUILD_DIR:-build-fuzz}"
cmake -S . -B "$build_dir" -DCMAKE_C_COMPILER=clang -DRELAY_FUZZ=ON -DRELAY_TESTS=OFF \
  -DRELAY_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build_dir" -j2

all=(config url metrics claim_row consumer tools cluster_slots key_slot)
read -r -a targets <<<"${FUZZ_TARGETS:-${all[*]}}"
jobs="${FUZZ_JOBS:-1}"

# Longest input per target: a config file of many lines, a few claimed rows
# with headers; the rest are short by nature.
max_len() {
  case "$1" in
    config | claim_row | consumer) echo 16384 ;;
    *) echo 4096 ;;
  esac
}

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

bin="$build_dir/tests/fuzz"
logs="$build_dir/fuzz-logs"
artifacts="$build_dir/artifacts"
mkdir -p "$logs" "$artifacts"

status=0
for t in "${targets[@]}"; do
  reg="tests/fuzz/regressions/$t"
  if [[ -d "$reg" ]] && compgen -G "$reg/*" >/dev/null; then
    if ! "$bin/fuzz_$t" -runs=0 -timeout=10 "$reg"/* >"$logs/$t.regressions.log" 2>&1; then
      echo "fuzz.sh: $t: a regression input fails again: see $logs/$t.regressions.log" >&2
      tail -n 30 "$logs/$t.regressions.log" >&2
      status=1
    fi
  fi
done

run() {
  local t="$1" work="$build_dir/corpus/$1"
  mkdir -p "$work" "$artifacts/$t"
  # The first directory takes what the run finds; the seeds are only read.
  "$bin/fuzz_$t" "$work" "tests/fuzz/corpus/$t" -max_total_time="$seconds" \
    -max_len="$(max_len "$t")" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/$t/" >"$logs/$t.log" 2>&1
}

pids=()
names=()
for t in "${targets[@]}"; do
  while ((${#pids[@]} >= jobs)); do
    wait "${pids[0]}" || true
    pids=("${pids[@]:1}")
  done
  run "$t" &
  pids+=($!)
  names+=("$t")
done
wait || true

for t in "${names[@]}"; do
  log="$logs/$t.log"
  done_line="$(grep -aE "^#[0-9]+[[:space:]]+DONE" "$log" | tail -n 1 || true)"
  runs_line="$(grep -aE "^Done [0-9]+ runs in" "$log" | tail -n 1 || true)"
  if grep -aqE '^==[0-9]+== ?ERROR|^SUMMARY: |runtime error:|^fuzz: |deadly signal' "$log" ||
    [[ -z "$runs_line" ]]; then
    echo "fuzz.sh: $t: FAILED (log $log; inputs in $artifacts/$t/)" >&2
    grep -aE "^==[0-9]+== ?ERROR|runtime error:|^fuzz: |^SUMMARY: |Test unit written" "$log" | head -n 10 >&2 || true
    status=1
  else
    echo "fuzz.sh: $t: ${done_line:-?} | $runs_line"
  fi
done
exit "$status"
