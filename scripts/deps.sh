#!/usr/bin/env bash
# Installs the Debian packages one use of outbox-relay needs, and nothing
# more, on Debian 12 (bookworm) or Debian 13 (trixie), chosen by
# VERSION_CODENAME in /etc/os-release. Idempotent: a machine that has every
# package does no network I/O. As root it installs what is missing with
# apt-get; otherwise it says what is missing and how to get it.
#
# Usage: scripts/deps.sh [build|package|demo|test]   (default: test)
#
#   build    compile and install the relay, the consumer library and the
#            example consumer (cmake --install): a C toolchain, CMake,
#            pkg-config and the headers of libpq, hiredis, c-ares and libev (and, on
#            trixie, of OpenSSL, for TLS to Redis with hiredis 1.2).
#   package  build, plus what scripts/package.sh uses to make and check the
#            Debian packages: dpkg-dev (dpkg-shlibdeps), file (CPack's
#            DEB generator) and lintian.
#   demo     build, plus what scripts/demo.sh and bench/run.sh run: PostgreSQL
#            (15 on bookworm, 17 on trixie), Redis and Python 3 with psycopg2
#            and redis-py for the harness (testkit/) that starts their
#            throwaway servers. The same two
#            modules are all the Python consumer of examples/python/ needs
#            (tests/integration/test_python_consumer.py runs it).
#   test     everything the whole suite, the analysis and the fuzzing need
#            (scripts/test.sh, scripts/analyze.sh, scripts/fuzz.sh, .ci/run):
#            demo and package, and the rest, below. The default, for CI.
#
# Installing redis-server or postgresql-15/-17 may start Debian's own services on
# ports 6379 and 5432. They are left alone: the tests and the demo start their
# own servers on free loopback ports.
#
# What the test profile adds:
#
# libcmocka-dev for the unit tests (cmake -DRELAY_TESTS=ON).
#
# clang-format checks that the C sources keep the project's .clang-format
# (scripts/format.sh, run by CI).
#
# clang and libclang-rt-14-dev (libFuzzer and the sanitizer runtimes of
# bookworm's clang 14; libclang-rt-19-dev for trixie's clang 19) build and run
# the fuzz targets (scripts/fuzz.sh).
#
# man-db lets tests/integration/test_package.py find the installed manual
# pages; curl runs the README's metrics command (tests/integration/test_readme.py).
#
# valkey-server (Valkey 8) is the second server the Redis-facing tests run
# against. Debian 12 has it in bookworm-backports only: on bookworm the test
# profile alone adds that suite to apt's sources
# (/etc/apt/sources.list.d/outbox-relay-backports.sources) and takes only
# valkey-server and valkey-tools from it; backports are never installed unless
# asked for by name, so nothing else on the machine changes. Debian 13 has
# Valkey 8.1 in trixie itself: no other source is added there.
#
# cppcheck, clang-tidy and valgrind are scripts/analyze.sh's.
#
# openssl makes the test CA and certificates, and stunnel4 carries Redis over
# TLS (tests/integration/test_tls.py); installing stunnel4 starts nothing.
#
# pgbouncer is the connection pooler tests/integration/test_pgbouncer.py puts
# between the relay and PostgreSQL. Debian enables its service on port 6432;
# that is left alone too: the test starts its own pooler on a free port.
#
# prometheus is here for its promtool, which checks and unit-tests
# monitoring/alerts.yml (tests/integration/test_monitoring.py). Under systemd,
# installing it also enables and starts Debian's Prometheus server on port
# 9090; that is left alone too: no test uses the server or that port (stop it
# with "systemctl disable --now prometheus" if you do not want it).
set -euo pipefail

usage() {
  echo "usage: scripts/deps.sh [build|package|demo|test]   (default: test)" >&2
  exit 64
}

profile="${1:-test}"
(($# <= 1)) || usage

case "$profile" in
  build | package | demo | test) ;;
  *) usage ;;
esac

# The release: its PostgreSQL major version, its clang's sanitizer runtimes
# and where Valkey comes from.
codename=
if [[ -r /etc/os-release ]]; then
  # shellcheck source=/dev/null
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
fi
case "$codename" in
  bookworm)
    pg=15
    clang_rt=libclang-rt-14-dev
    valkey_suite=bookworm-backports
    tls=()
    tls_static=()
    ;;
  trixie)
    pg=17
    clang_rt=libclang-rt-19-dev
    valkey_suite=
    # hiredis 1.2's SSL library is in libhiredis-dev; TLS to Redis also
    # calls OpenSSL itself (common/tls.c). The package test links the
    # consumer library fully statically, OpenSSL's libcrypto with it, which
    # takes zlib's and zstd's static libraries.
    tls=(libssl-dev)
    tls_static=(zlib1g-dev libzstd-dev)
    ;;
  *)
    echo "deps.sh: unsupported system (VERSION_CODENAME '${codename:-unknown}' in" \
      "/etc/os-release): this script supports Debian 12 (bookworm) and Debian 13 (trixie)." >&2
    echo "deps.sh: elsewhere, install by hand: a C toolchain, CMake, pkg-config, the" \
      "headers of libpq, hiredis, c-ares and libev; for the demo and the tests PostgreSQL 15 or" \
      "later (server and client), Redis 7 or later, Python 3 with psycopg2 and redis-py;" \
      "for the whole suite also cmocka, clang-format, clang with libFuzzer, Valkey 8 and the" \
      "tools listed in scripts/deps.sh (or set OUTBOX_RELAY_PG_BINDIR to PostgreSQL's bin" \
      "directory)." >&2
    exit 1
    ;;
esac

build=(build-essential cmake pkg-config libpq-dev libhiredis-dev libev-dev libc-ares-dev "${tls[@]}")
package=(dpkg-dev file lintian)
demo=("postgresql-$pg" "postgresql-client-$pg" redis-server python3 python3-psycopg2 python3-redis)
test=(
  libcmocka-dev clang-format clang "$clang_rt" man-db curl pgbouncer python3-yaml
  prometheus openssl stunnel4 cppcheck clang-tidy valgrind "${tls_static[@]}"
)
valkey=(valkey-server valkey-tools)
backports=()
case "$profile" in
  build) packages=("${build[@]}") ;;
  package) packages=("${build[@]}" "${package[@]}") ;;
  demo) packages=("${build[@]}" "${demo[@]}") ;;
  test)
    packages=("${build[@]}" "${package[@]}" "${demo[@]}" "${test[@]}")
    # From bookworm-backports on bookworm, from the release itself on trixie
    # (see above).
    if [[ -n "$valkey_suite" ]]; then
      backports=("${valkey[@]}")
    else
      packages+=("${valkey[@]}")
    fi
    ;;
esac
backports_list=/etc/apt/sources.list.d/outbox-relay-backports.sources

installed() {
  [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]
}

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "deps.sh: dpkg-query not found: this script supports Debian 12 and 13 only." >&2
  echo "deps.sh: install by hand: ${packages[*]} ${backports[*]}" >&2
  exit 1
fi

missing=()
for p in "${packages[@]}"; do
  installed "$p" || missing+=("$p")
done
missing_backports=()
for p in "${backports[@]}"; do
  installed "$p" || missing_backports+=("$p")
done

if ((${#missing[@]} == 0 && ${#missing_backports[@]} == 0)); then
  exit 0
fi

all_missing=("${missing[@]}" "${missing_backports[@]}")
if ((EUID != 0)); then
  echo "deps.sh: the $profile profile misses Debian packages: ${all_missing[*]}" >&2
  hint="deps.sh: run this script as root, or install them:"
  if ((${#missing[@]} != 0)); then
    hint+=" sudo apt-get install ${missing[*]};"
  fi
  if ((${#missing_backports[@]} != 0)); then
    hint+=" and from $valkey_suite: sudo apt-get install -t $valkey_suite"
    hint+=" ${missing_backports[*]};"
  fi
  echo "${hint%;}" >&2
  exit 1
fi

echo "deps.sh: installing ${all_missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ((${#missing_backports[@]} != 0)) && ! grep -rqs "$valkey_suite" /etc/apt/sources.list \
  /etc/apt/sources.list.d/; then
  cat >"$backports_list" <<EOF
# Added by outbox-relay's scripts/deps.sh, for valkey-server (Valkey 8).
Types: deb
URIs: http://deb.debian.org/debian
Suites: $valkey_suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
fi
apt-get update
if ((${#missing[@]} != 0)); then
  apt-get install -y --no-install-recommends "${missing[@]}"
fi
if ((${#missing_backports[@]} != 0)); then
  apt-get install -y --no-install-recommends -t "$valkey_suite" "${missing_backports[@]}"
fi

still=()
for p in "${all_missing[@]}"; do
  installed "$p" || still+=("$p")
done
if ((${#still[@]} != 0)); then
  echo "deps.sh: apt-get did not install: ${still[*]}" >&2
  exit 1
fi
