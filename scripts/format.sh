#!/usr/bin/env bash
# Checks (--check, the default) or applies (--fix) .clang-format to every C
# source and header of the project. CI runs the check; a file that differs
# fails it with the list of files, and "scripts/format.sh --fix" mends them.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

mode="${1:---check}"
case "$mode" in
  --check | --fix) ;;
  *) echo "usage: scripts/format.sh [--check|--fix]" >&2; exit 64 ;;
esac

if ! command -v clang-format >/dev/null 2>&1; then
  echo "format.sh: clang-format not found: install the Debian package clang-format" >&2
  exit 1
fi

mapfile -t files < <(git ls-files -- '*.c' '*.h')
if [[ "$mode" == --fix ]]; then
  clang-format -i "${files[@]}"
  exit 0
fi

bad=()
for f in "${files[@]}"; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then
    bad+=("$f")
  fi
done
if ((${#bad[@]} != 0)); then
  echo "format.sh: not formatted as .clang-format asks (run scripts/format.sh --fix):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "format.sh: ${#files[@]} files formatted as .clang-format asks"
