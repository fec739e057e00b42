#!/usr/bin/env bash
# Installs what outbox-relay needs to build and test on Debian 12, and nothing
# more. Idempotent: a machine that has every package does no network I/O.
# As root it installs what is missing with apt-get; otherwise it says what is
# missing and how to get it.
#
# Installing redis-server or postgresql-15 may start Debian's own services on
# ports 6379 and 5432. They are left alone: the tests start their own servers
# on free loopback ports.
#
# clang-format checks that the C sources keep the project's .clang-format
# (scripts/format.sh, run by CI).
#
# clang and libclang-rt-14-dev (libFuzzer and the sanitizer runtimes of
# bookworm's clang 14) build and run the fuzz targets (scripts/fuzz.sh).
#
# dpkg-dev, file and lintian build and check the Debian packages
# (scripts/package.sh); man-db lets tests/integration/test_package.py find
# the installed manual pages.
#
# valkey-server (Valkey 8) is the second server the Redis-facing tests run
# against. Debian 12 has it in bookworm-backports only: the script adds that
# suite to apt's sources (/etc/apt/sources.list.d/outbox-relay-backports.sources)
# and takes only valkey-server and valkey-tools from it; backports are never
# installed unless asked for by name, so nothing else on the machine changes.
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

packages=(
  build-essential cmake pkg-config clang-format clang libclang-rt-14-dev
  dpkg-dev file lintian man-db
  libpq-dev libhiredis-dev libev-dev libcmocka-dev
  postgresql-15 postgresql-client-15 redis-server pgbouncer
  python3 python3-psycopg2 python3-redis python3-yaml
  prometheus openssl stunnel4
  cppcheck clang-tidy valgrind
)
# From bookworm-backports (see above).
backports=(valkey-server valkey-tools)
backports_list=/etc/apt/sources.list.d/outbox-relay-backports.sources

installed() {
  [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]
}

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "deps.sh: dpkg-query not found: this script supports Debian 12 only." >&2
  echo "deps.sh: install by hand: ${packages[*]}" >&2
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

if ((EUID != 0)); then
  echo "deps.sh: missing Debian packages: ${missing[*]} ${missing_backports[*]}" >&2
  echo "deps.sh: run this script as root, or install them: sudo apt-get install" \
    "${missing[*]}; and from bookworm-backports: ${missing_backports[*]}" >&2
  exit 1
fi

echo "deps.sh: installing ${missing[*]} ${missing_backports[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ((${#missing_backports[@]} != 0)) && ! grep -rqs "bookworm-backports" /etc/apt/sources.list \
  /etc/apt/sources.list.d/; then
  cat >"$backports_list" <<'EOF'
# Added by outbox-relay's scripts/deps.sh, for valkey-server (Valkey 8).
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
fi
apt-get update
if ((${#missing[@]} != 0)); then
  apt-get install -y --no-install-recommends "${missing[@]}"
fi
if ((${#missing_backports[@]} != 0)); then
  apt-get install -y --no-install-recommends -t bookworm-backports "${missing_backports[@]}"
fi

still=()
for p in "${missing[@]}" "${missing_backports[@]}"; do
  installed "$p" || still+=("$p")
done
if ((${#still[@]} != 0)); then
  echo "deps.sh: apt-get did not install: ${still[*]}" >&2
  exit 1
fi
