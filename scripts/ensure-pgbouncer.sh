#!/usr/bin/env bash
# Makes sure a PgBouncer that can carry sqlx's named prepared statements in
# transaction mode (1.21 or newer, `max_prepared_statements`) is at hand for
# the pooler tests, and exports PGBOUNCER_BIN with its path. Sourced by
# scripts/test.
#
# Debian 12's pgbouncer is 1.18, which cannot: in transaction mode a pooled
# server connection already holds `sqlx_s_1` and the next client's PREPARE
# fails. Debian 13 (trixie) ships 1.24.1, but its binary package is built
# against trixie's libc and will not install on Debian 12. So we take the
# trixie *source* package (the upstream tarball and Debian's patches, the
# security fixes among them), check both against the SHA-256 sums trixie's
# signed Sources index lists for them, and build it here: about a minute
# on 2 cores, once; the binary is cached under ~/.cache/pgonce.
set -euo pipefail

PGBOUNCER_VERSION=1.24.1
PGBOUNCER_DEBIAN_REVISION=1+deb13u2
PGBOUNCER_ORIG_SHA256=da72a3aba13072876d055a3e58dd4aba4a5de4ed6148e73033185245598fd3e0
PGBOUNCER_DEBIAN_SHA256=2325bcaa2e71919d399b9e5aef5b94ff988fc1f1d296908c3937b682b7be5cbb
PGBOUNCER_POOL=https://deb.debian.org/debian/pool/main/p/pgbouncer

pgbouncer_cache="${XDG_CACHE_HOME:-$HOME/.cache}/pgonce/pgbouncer-$PGBOUNCER_VERSION-$PGBOUNCER_DEBIAN_REVISION"

build_pgbouncer() {
  local work sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  local missing=()
  for pkg in gcc make pkg-config libevent-dev libssl-dev curl xz-utils patch; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "building PgBouncer needs ${missing[*]}; installing with apt-get" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi

  work="$(mktemp -d)"
  local orig="pgbouncer_$PGBOUNCER_VERSION.orig.tar.gz"
  local debian="pgbouncer_$PGBOUNCER_VERSION-$PGBOUNCER_DEBIAN_REVISION.debian.tar.xz"
  echo "building PgBouncer $PGBOUNCER_VERSION from Debian 13's source package (once; cached in $pgbouncer_cache)" >&2
  curl -fsSL --retry 3 -o "$work/$orig" "$PGBOUNCER_POOL/$orig"
  curl -fsSL --retry 3 -o "$work/$debian" "$PGBOUNCER_POOL/$debian"
  echo "$PGBOUNCER_ORIG_SHA256  $work/$orig" | sha256sum --check --quiet
  echo "$PGBOUNCER_DEBIAN_SHA256  $work/$debian" | sha256sum --check --quiet

  tar -xzf "$work/$orig" -C "$work"
  local src="$work/pgbouncer-$PGBOUNCER_VERSION"
  tar -xJf "$work/$debian" -C "$src"
  # Debian's patch series: its security fixes, and its default config.
  while read -r patch; do
    case "$patch" in ''|'#'*) continue ;; esac
    patch -d "$src" -p1 --quiet < "$src/debian/patches/$patch"
  done < "$src/debian/patches/series"

  (
    cd "$src"
    ./configure --prefix="$pgbouncer_cache" --without-cares --without-pam \
      --without-ldap --without-systemd >"$work/configure.log" 2>&1 \
      || { cat "$work/configure.log" >&2; exit 1; }
    make -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -40 "$work/make.log" >&2; exit 1; }
    make install >"$work/install.log" 2>&1 || { cat "$work/install.log" >&2; exit 1; }
  )
  rm -rf "$work"
}

if [ -z "${PGBOUNCER_BIN:-}" ]; then
  if [ ! -x "$pgbouncer_cache/bin/pgbouncer" ]; then
    build_pgbouncer
  fi
  export PGBOUNCER_BIN="$pgbouncer_cache/bin/pgbouncer"
fi
