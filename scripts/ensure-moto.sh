#!/usr/bin/env bash
# Makes sure moto's server mode (`moto_server`, PyPI `moto[server]`) is on
# PATH: the pgonce-sqs tests start one per test on a loopback port. Sourced
# by scripts/test; installs with pip (user install) when missing.
set -euo pipefail

# A --user install lands here, which is not on every PATH.
export PATH="$HOME/.local/bin:$PATH"

if ! command -v moto_server >/dev/null 2>&1; then
  echo "moto_server not found; installing moto[server] with pip" >&2
  if command -v pip3 >/dev/null 2>&1; then PIP=pip3; else PIP="python3 -m pip"; fi
  $PIP install --quiet --user 'moto[server]' || $PIP install --quiet 'moto[server]'
  hash -r
  command -v moto_server >/dev/null 2>&1 || {
    echo "moto_server still missing after pip install; the pgonce-sqs tests will fail" >&2
  }
fi
