#!/usr/bin/env bash
# Makes sure PostgreSQL server binaries (initdb, postgres) are installed, so
# the throwaway clusters of the demo and the tests can start. Skipped when
# DATABASE_URL names a server to use instead. Sourced by scripts/demo and
# scripts/test; installs with apt-get (Debian/Ubuntu) when they are missing.
set -euo pipefail

have_server_binaries() {
  local dir
  for dir in "${PG_BINDIR:-}" "$(pg_config --bindir 2>/dev/null || true)" /usr/lib/postgresql/*/bin; do
    [ -n "$dir" ] && [ -x "$dir/initdb" ] && [ -x "$dir/postgres" ] && return 0
  done
  return 1
}

if [ -z "${DATABASE_URL:-}" ] && ! have_server_binaries; then
  if command -v apt-get >/dev/null 2>&1; then
    echo "PostgreSQL server binaries not found; installing them with apt-get" >&2
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
  else
    echo "PostgreSQL server binaries not found: install PostgreSQL or set DATABASE_URL" >&2
    exit 1
  fi
fi
