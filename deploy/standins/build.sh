#!/usr/bin/env bash
# Builds stand-ins for the public images compose.yaml and the Dockerfile use, from Debian
# packages, under the same names and tags, for a machine that cannot pull from Docker Hub
# (deploy/compose-check.sh runs it when a pull fails). A stand-in is not the real image: it has
# the same entrypoint, ports, user and paths where compose.yaml relies on them.
#
#   deploy/standins/build.sh [IMAGE...]   (default: all four)
#
# The base is a debootstrapped Debian bookworm (minbase), its root filesystem cached under
# $NORI_CHECK_CACHE (default /var/cache/nori-compose-check), so a rerun builds nothing that is
# current: each stand-in carries a label with the hash of its inputs and is rebuilt only when
# they change. An image of that name without the label (a real one) is never replaced.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${NORI_CHECK_CACHE:-/var/cache/nori-compose-check}"
mirror="${NORI_CHECK_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
base=nori-check/debian:bookworm-minbase
label=org.nori.compose-check.standin

declare -A dirs=(
  [python:3.11-slim]=python
  [redis:7-alpine]=redis
  [prom/prometheus:v2.55.1]=prometheus
  [jaegertracing/all-in-one:1.62.0]=jaeger
)

log() { echo "standins: $*"; }

# The hash of a stand-in's inputs: its folder, the extra CA certificates, the base's tarball.
inputs_hash() {
  local dir="$1"
  {
    (cd "$here/$dir" && find . -type f -print0 | sort -z | xargs -0 sha256sum)
    cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true
    cat "$cache/bookworm-minbase.id" 2>/dev/null || true
  } | sha256sum | cut -c1-16
}

ensure_base() {
  mkdir -p "$cache"
  local tarball="$cache/bookworm-minbase.tar.gz"
  if [ ! -s "$tarball" ]; then
    command -v debootstrap >/dev/null || { echo "debootstrap is missing (apt-get install debootstrap)" >&2; return 1; }
    local root
    root="$(mktemp -d /var/tmp/nori-check-rootfs.XXXXXX)"
    log "debootstrap bookworm (minbase) from $mirror into $root (once; cached in $tarball)"
    if ! debootstrap --variant=minbase bookworm "$root" "$mirror" >"$cache/debootstrap.log" 2>&1; then
      tail -20 "$cache/debootstrap.log" >&2
      rm -rf "$root"
      return 1
    fi
    cat >"$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${NORI_CHECK_DEBIAN_SECURITY:-http://deb.debian.org/debian-security} bookworm-security main
SOURCES
    # As Debian's own container images: no recommends, no caches, no man pages kept.
    printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
      >"$root/etc/apt/apt.conf.d/90nori-check-norecommends"
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/tmp/* "$root"/var/log/*.log
    tar -C "$root" --numeric-owner -czf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    sha256sum "$tarball" | cut -c1-16 >"$cache/bookworm-minbase.id"
    rm -rf "$root"
  fi
  local want have
  want="$(cat "$cache/bookworm-minbase.id")"
  have="$(docker image inspect -f "{{index .Config.Labels \"$label-hash\"}}" "$base" 2>/dev/null || true)"
  if [ "$have" != "$want" ]; then
    log "importing $tarball as $base"
    docker import -c "LABEL $label=base $label-hash=$want" -c 'CMD ["bash"]' \
      -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      "$tarball" "$base" >/dev/null
  fi
}

build_one() {
  local image="$1" dir="${dirs[$1]}"
  local current hash context
  current="$(docker image inspect -f "{{index .Config.Labels \"$label\"}}" "$image" 2>/dev/null || echo none)"
  if [ "$current" != none ] && [ -z "$current" ]; then
    log "$image: a real image of that name is here; kept"
    return 0
  fi
  hash="$(inputs_hash "$dir")"
  if [ "$(docker image inspect -f "{{index .Config.Labels \"$label-hash\"}}" "$image" 2>/dev/null || true)" = "$hash" ]; then
    log "$image: stand-in is current ($hash)"
    return 0
  fi
  context="$(mktemp -d)"
  cp -a "$here/$dir/." "$context/"
  mkdir -p "$context/extra-ca"
  cp /usr/local/share/ca-certificates/*.crt "$context/extra-ca/" 2>/dev/null || true
  log "$image: building the stand-in from deploy/standins/$dir"
  local start=$SECONDS
  if ! docker build --network host -q --label "$label=$dir" --label "$label-hash=$hash" \
      -t "$image" "$context" >"$cache/build-$dir.log" 2>&1; then
    tail -30 "$cache/build-$dir.log" >&2
    rm -rf "$context"
    return 1
  fi
  rm -rf "$context"
  log "$image: built in $((SECONDS - start)) s"
}

ensure_base
if [ "$#" -eq 0 ]; then set -- "${!dirs[@]}"; fi
for image in "$@"; do
  [ -n "${dirs[$image]:-}" ] || { echo "no stand-in for $image" >&2; exit 1; }
  build_one "$image"
done
