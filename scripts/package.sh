#!/usr/bin/env bash
# Builds the Debian packages of outbox-relay from this source tree:
#   outbox-relay_<version>_<arch>.deb            the daemon, units, manual pages
#   liboutbox-consumer1_<version>_<arch>.deb     the consumer library
#   liboutbox-consumer-dev_<version>_<arch>.deb  its headers and link files
# into the package build directory, then checks them with lintian, which must
# report no errors. Installs what is missing first (scripts/deps.sh package:
# the build's packages, dpkg-dev, file and lintian, and nothing else).
#
# Environment:
#   PACKAGE_BUILD_DIR  build directory (default build-package, relative to
#                      the repository root)
#   RELAY_WERROR       ON: warnings are errors, as in CI; the packages are the
#                      one optimised (Release) build the suite compiles, where
#                      GCC sees further (format truncation, for one)
# Prints the paths of the packages, one a line, on stdout.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash scripts/deps.sh package >&2

build_dir="${PACKAGE_BUILD_DIR:-build-package}"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
  -DRELAY_TESTS=OFF -DRELAY_DEB_PACKAGE=ON -DRELAY_WERROR="${RELAY_WERROR:-OFF}" >&2
cmake --build "$build_dir" -j2 >&2
rm -f "$build_dir"/*.deb
(cd "$build_dir" && cpack -G DEB) >&2

debs=("$build_dir"/*.deb)
lintian --fail-on error --info "${debs[@]}" >&2
for deb in "${debs[@]}"; do
  echo "$(cd "$(dirname "$deb")" && pwd)/$(basename "$deb")"
done
