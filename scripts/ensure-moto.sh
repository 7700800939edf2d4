#!/usr/bin/env bash
# Makes sure moto's server mode (PyPI `moto[server]`) imports in python3:
# the pgonce-sqs tests start one per test on a loopback port. Sourced
# by scripts/test; installs with pip (user install) when missing.
set -euo pipefail

# A --user install lands here, which is not on every PATH.
export PATH="$HOME/.local/bin:$PATH"

# The test kit runs moto's server from python3 (crates/pgonce-testkit/src/
# moto_server.py), so moto must import there.
if ! python3 -c 'import moto.server, moto.sqs' >/dev/null 2>&1; then
  echo "moto not found for python3; installing moto[server] with pip" >&2
  python3 -m pip install --quiet --user 'moto[server]' || python3 -m pip install --quiet 'moto[server]'
  python3 -c 'import moto.server, moto.sqs' >/dev/null 2>&1 || {
    echo "moto still missing after pip install; the SQS tests will fail" >&2
  }
fi
