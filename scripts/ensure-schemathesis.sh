#!/usr/bin/env bash
# Makes sure the pinned Schemathesis is installed in a virtualenv the project
# owns (.tools/schemathesis), and exports SCHEMATHESIS with its path:
# the incident API's fuzz test serves a real instance and runs it. Sourced by
# scripts/test; installs with pip when missing. Needs Python >= 3.10.
set -euo pipefail

SCHEMATHESIS_VERSION=4.32.5
_st_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_st_venv="$_st_root/.tools/schemathesis-$SCHEMATHESIS_VERSION"

if [ ! -x "$_st_venv/bin/st" ]; then
  echo "schemathesis $SCHEMATHESIS_VERSION not found; installing into $_st_venv" >&2
  _st_python=
  for _st_candidate in python3.13 python3.12 python3.11 python3.10 python3; do
    if "$_st_candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1; then
      _st_python="$_st_candidate"
      break
    fi
  done
  [ -n "$_st_python" ] || { echo "no Python >= 3.10 found for schemathesis" >&2; return 0 2>/dev/null || exit 0; }
  rm -rf "$_st_venv"
  "$_st_python" -m venv "$_st_venv"
  "$_st_venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "schemathesis==$SCHEMATHESIS_VERSION" || {
    echo "installing schemathesis failed; the API fuzz test will fail under CI" >&2
  }
fi
if [ -x "$_st_venv/bin/st" ]; then
  export SCHEMATHESIS="$_st_venv/bin/st"
fi
