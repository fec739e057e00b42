#!/usr/bin/env bash
# Static and dynamic analysis, beside the tests (CI runs it after the first
# test pass):
#   cppcheck    warning, performance and portability checks over the C
#               sources; a finding that is not a defect carries an inline
#               suppression with its reason
#   clang-tidy  the curated checks of .clang-tidy (bugprone, the static
#               analyzer), every finding an error
#   valgrind    memcheck over every unit test, and the relay under memcheck
#               in a few integration files (delivery, dedup, the metrics
#               endpoint, the dead-letter tools): a report fails them
#
# Usage: scripts/analyze.sh [static|valgrind]   (default: both)
# Environment: BUILD_DIR (default build), RELAY_WERROR as scripts/test.sh.
set -euo pipefail

what="${1:-all}"
case "$what" in
  all | static | valgrind) ;;
  *) echo "usage: scripts/analyze.sh [static|valgrind]" >&2; exit 64 ;;
esac

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/deps.sh test

build_dir="${BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -DRELAY_TESTS=ON -DRELAY_WERROR="${RELAY_WERROR:-OFF}" -DRELAY_SANITIZE= \
  -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" >/dev/null
cmake --build "$build_dir" -j2

sources=(common consumer core relay tools cli examples)
status=0

if [[ "$what" != valgrind ]]; then
  echo "== cppcheck"
  cppcheck --enable=warning,performance,portability --std=c11 --inline-suppr --quiet \
    --error-exitcode=1 -I . -I include -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE \
    -DRELAY_VERSION='"analysis"' "${sources[@]}" || status=1

  echo "== clang-tidy (.clang-tidy)"
  # Only the product's sources: the tests' compile commands are left out.
  run-clang-tidy -p "$build_dir" -j 2 -quiet "$root/(common|consumer|core|relay|tools|cli|examples)/" \
    >"$build_dir/clang-tidy.log" 2>&1 || status=1
  if grep -E "(warning|error):" "$build_dir/clang-tidy.log"; then
    status=1
  else
    echo "clang-tidy: no findings"
  fi
fi

if [[ "$what" != static ]]; then
  echo "== valgrind memcheck: unit tests"
  for t in "$build_dir"/tests/test_*; do
    [[ -x "$t" && -f "$t" ]] || continue
    valgrind --tool=memcheck --leak-check=full --errors-for-leak-kinds=definite \
      --error-exitcode=99 -q "$t" >"$build_dir/valgrind-$(basename "$t").log" 2>&1 || {
      echo "valgrind: $(basename "$t") failed:"; tail -40 "$build_dir/valgrind-$(basename "$t").log"
      status=1
    }
  done
  echo "== valgrind memcheck: the relay in integration tests"
  OUTBOX_RELAY_VALGRIND=1 ctest --test-dir "$build_dir" --output-on-failure -j2 \
    -R '^integration\.(delivery|entry_ids|metrics_http|dlq_tools)$' || status=1
fi
exit "$status"
