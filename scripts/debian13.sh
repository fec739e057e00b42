#!/usr/bin/env bash
# The project on Debian 13 (trixie), from a Debian 12 machine: PostgreSQL 17,
# Redis 8.0, hiredis 1.2, GCC 14. Makes a trixie root file system
# with mmdebstrap, copies this tree's tracked files into it and runs there, as
# a newcomer on a fresh Debian 13 machine would:
#
#   scripts/deps.sh test          the packages, from trixie's own archive
#   scripts/demo.sh --seconds 5   the README's demo, which fails unless every
#                                 order was relayed and handled once
#   scripts/test.sh --quick       warnings as errors; the unit tests and the
#                                 quick integration tier. The Valkey reruns are
#                                 left out: they test the server, not this
#                                 build, and the Debian 12 pass runs them
#   integration.package           the slow tier's package test: scripts/package.sh
#                                 builds the three .deb packages (lintian-clean),
#                                 dpkg installs them, the installed relay and
#                                 consumer deliver a message, they are purged
#
# CI runs it after the Debian 12 passes (.ci/run). Needs root (mmdebstrap's
# root mode, chroot, mount) and Debian's archive.
#
# Environment:
#   DEBIAN13_ROOT    where the root file system goes (default
#                    /var/tmp/outbox-relay-debian13). Kept between runs:
#                    deps.sh then installs nothing, and the tree is copied
#                    afresh each time. Remove it to start from nothing.
#   DEBIAN13_MIRROR  the archive (default http://deb.debian.org/debian)
# Exits non-zero if any step failed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

target="${DEBIAN13_ROOT:-/var/tmp/outbox-relay-debian13}"
mirror="${DEBIAN13_MIRROR:-http://deb.debian.org/debian}"

if ((EUID != 0)); then
  echo "debian13.sh: needs root, for mmdebstrap's root mode, chroot and mount;" \
    "run it as root (CI does)." >&2
  exit 1
fi
if ! command -v mmdebstrap >/dev/null 2>&1; then
  echo "debian13.sh: installing mmdebstrap" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends mmdebstrap >&2 ||
    {
      apt-get update >&2 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends mmdebstrap >&2
    }
fi

release() {
  [[ -r "$target/etc/os-release" ]] && (. "$target/etc/os-release" && echo "${VERSION_CODENAME:-}")
}

if [[ "$(release)" != trixie ]]; then
  if [[ -e "$target" ]]; then
    echo "debian13.sh: $target exists and is not a Debian 13 root; remove it or set" \
      "DEBIAN13_ROOT to another directory." >&2
    exit 1
  fi
  echo "debian13.sh: making a Debian 13 root in $target" >&2
  # The apt variant: apt and what it needs; deps.sh adds the rest.
  mmdebstrap --variant=apt --include=ca-certificates trixie "$target.new" "$mirror" >&2
  mv "$target.new" "$target"
fi

# /proc, /dev and /sys for PostgreSQL, the sanitizer-free build and lintian;
# the host's resolver for apt. Unmounted on any exit, last mounted first.
mounted=()
unmount() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -R "${mounted[i]}" 2>/dev/null || umount -lR "${mounted[i]}" 2>/dev/null || true
  done
}
trap unmount EXIT
# The root a mount point of its own, so that a test can make a mount
# namespace inside it (unshare -m changes the propagation of /, which must be
# a mount point): tests/integration/test_resolve.py gives the relay a
# resolv.conf of its own that way.
if ! mountpoint -q "$target"; then
  mount --bind "$target" "$target"
  mounted+=("$target")
fi
for fs in proc sys dev; do
  mkdir -p "$target/$fs"
  if ! mountpoint -q "$target/$fs"; then
    case "$fs" in
      proc) mount -t proc proc "$target/proc" ;;
      *) mount --rbind "/$fs" "$target/$fs" && mount --make-rslave "$target/$fs" ;;
    esac
    mounted+=("$target/$fs")
  fi
done
cp -L /etc/resolv.conf "$target/etc/resolv.conf"

# The tracked files as they are in this tree, changes included.
rm -rf "$target/src"
mkdir -p "$target/src"
git ls-files -z --cached --others --exclude-standard |
  tar --null -T - -cf - | tar -xf - -C "$target/src"

chroot "$target" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  CI="${CI:-}" /bin/bash -euo pipefail -c '
    cd /src
    echo "debian13.sh: $(. /etc/os-release && echo "$PRETTY_NAME")" >&2
    bash scripts/deps.sh test
    BUILD_DIR=build-demo bash scripts/demo.sh --seconds 5
    export RELAY_WERROR=ON
    TEST_EXCLUDE_LABEL=valkey bash scripts/test.sh --quick
    ctest --test-dir build --output-on-failure -R "^integration\.package\$"
  '
