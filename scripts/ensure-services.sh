#!/usr/bin/env bash
# Make sure what the test suite needs outside Python is here: a PostgreSQL server answering on
# 127.0.0.1:5432, and Chromium for the HTML-report rendering test. Installs/starts them if not.
# With --python-venv it only installs what `python3 -m venv` needs (scripts/test.sh asks when it fails).
set -euo pipefail

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

if [ "${1:-}" = --python-venv ]; then
  ver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  echo "ensure-services: installing python${ver}-venv" >&2
  apt_install "python${ver}-venv" || apt_install python3-venv
  exit 0
fi

pg_answers() { python3 - "$@" <<'PY'
import socket, sys
s = socket.socket(); s.settimeout(1)
try:
    s.connect(("127.0.0.1", 5432))
except OSError:
    sys.exit(1)
PY
}

if [ -z "${LORALEDGER_TEST_PG_URL:-}" ] && ! pg_answers; then
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    echo "ensure-services: installing PostgreSQL" >&2
    apt_install postgresql
  fi
  ver=$(ls /etc/postgresql | sort -V | tail -n 1)
  as_root pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
  for _ in $(seq 1 30); do pg_answers && break; sleep 1; done
  pg_answers || { echo "ensure-services: PostgreSQL does not answer on 127.0.0.1:5432" >&2; exit 1; }
fi
# a server we did not configure may want a password over TCP: give the tests one that works
if [ -z "${LORALEDGER_TEST_PG_URL:-}" ]; then
  if ! python3 -c "import psycopg; psycopg.connect('host=127.0.0.1 user=postgres dbname=postgres connect_timeout=3').close()" 2>/dev/null; then
    if command -v runuser >/dev/null && id postgres >/dev/null 2>&1; then
      as_root runuser -u postgres -- psql -q -c "ALTER USER postgres PASSWORD 'postgres'" >/dev/null
      echo "LORALEDGER_TEST_PG_URL=postgresql+psycopg://postgres:postgres@127.0.0.1:5432/postgres"
    fi
  fi
fi

if ! command -v chromium >/dev/null 2>&1; then
  echo "ensure-services: installing Chromium (HTML report rendering test)" >&2
  apt_install chromium
fi
