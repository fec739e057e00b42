#!/usr/bin/env bash
# The test command: installs what is missing, configures, builds and runs every
# test in two tiers. Works from any directory.
#   quick  the unit tests and the quick integration files, two at a time
#          (each starts its own PostgreSQL, Redis and relay on free ports);
#   slow   faults, kills, restarts, resources, the vanished host and a
#          three-minute soak, one at a time, since they load the machine on
#          purpose.
#
# Usage: scripts/test.sh [--quick]   (--quick: the quick tier alone)
#
# One integration test, after a build into build/: through ctest, which sets
# its environment,
#   ctest --test-dir build -R '^integration\.delivery$' --output-on-failure
# or the file by hand from the repository root, with the root on PYTHONPATH
# for the harness (testkit/):
#   PYTHONPATH=. /usr/bin/python3 tests/integration/test_delivery.py
#
# Environment:
#   BUILD_DIR       build directory, relative to the repository root (default build)
#   BUILD_TYPE      CMAKE_BUILD_TYPE (default RelWithDebInfo)
#   RELAY_WERROR    ON to turn compiler warnings into errors (default OFF)
#   RELAY_SANITIZE  e.g. address,undefined (default none); leaves out the
#                   tests labelled nosan
#   TEST_EXCLUDE_LABEL  a ctest label (or regular expression of labels) whose
#                   tests are left out, e.g. valkey (default none)
# Exits with ctest's status: non-zero if any test failed.
set -euo pipefail

quick=0
case "${1:-}" in
  --quick) quick=1 ;;
  "") ;;
  *) echo "usage: scripts/test.sh [--quick]" >&2; exit 64 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash scripts/deps.sh test

build_dir="${BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -DRELAY_TESTS=ON \
  -DRELAY_WERROR="${RELAY_WERROR:-OFF}" \
  -DRELAY_SANITIZE="${RELAY_SANITIZE:-}" \
  -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}"
cmake --build "$build_dir" -j2

if [[ -n "${RELAY_SANITIZE:-}" ]]; then
  # Leaks in the daemon fail the tests: the integration harness reads the
  # daemon's stderr for sanitizer reports, and unit tests exit non-zero.
  export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}"
  export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
fi

# Every log of this run, for the check that no password reached one
# (tests/integration/test_secrets.py).
rm -rf "$build_dir/test-logs"

# With the sanitizers, the tests they add little to (label nosan: the soak,
# the resource, package and README tests, the Valkey reruns) are left out.
left_out="${TEST_EXCLUDE_LABEL:-}"
if [[ -n "${RELAY_SANITIZE:-}" ]]; then
  left_out="nosan${left_out:+|$left_out}"
fi
exclude=()
if [[ -n "$left_out" ]]; then
  exclude=(-LE "$left_out")
fi

status=0
ctest --test-dir "$build_dir" --output-on-failure -L unit -j2 || status=$?
ctest --test-dir "$build_dir" --output-on-failure -L quick "${exclude[@]}" -j2 || status=$?
if ((quick == 0)); then
  ctest --test-dir "$build_dir" --output-on-failure -L slow "${exclude[@]}" || status=$?
fi
exit "$status"
