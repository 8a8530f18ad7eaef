#!/usr/bin/env bash
# Docker without an image registry: start the engine when it is not running, and build the local base image
# that the Dockerfiles take as BASE_IMAGE (Debian bookworm minbase + python3 in a venv on PATH, the same
# shape as python:3.11-slim-bookworm), made with mmdebstrap and `docker import`, kept between runs.
#
#   scripts/docker_base.sh            # both: dockerd running, then the base image (skipped when present)
#   scripts/docker_base.sh dockerd    # only make sure the engine answers `docker info`
#   scripts/docker_base.sh base       # only the base image
#
# Needs root and Debian's docker.io + mmdebstrap (apt-get install -y docker.io docker-compose mmdebstrap).
# Environment: SWARMSERVE_BASE_IMAGE (default swarmserve-base:bookworm), DEBIAN_MIRROR (default: this
# machine's apt mirror, else deb.debian.org), DOCKERD_LOG (default /var/log/swarmserve-dockerd.log).
set -euo pipefail

BASE_IMAGE="${SWARMSERVE_BASE_IMAGE:-swarmserve-base:bookworm}"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/swarmserve-dockerd.log}"

start_dockerd() {
  if docker info >/dev/null 2>&1; then
    return 0
  fi
  command -v dockerd >/dev/null 2>&1 || { echo "no dockerd: apt-get install -y docker.io" >&2; return 1; }
  echo "starting dockerd (log: $DOCKERD_LOG)"
  nohup dockerd >"$DOCKERD_LOG" 2>&1 &
  for _ in $(seq 1 60); do
    if docker info >/dev/null 2>&1; then
      return 0
    fi
    sleep 1
  done
  echo "dockerd did not answer within 60 s; its log:" >&2
  tail -n 20 "$DOCKERD_LOG" >&2
  return 1
}

host_mirror() {
  # the first deb822 or one-line Debian source of this machine, so the image uses the mirror apt here uses
  local uri
  uri=$(grep -hoE '^(URIs:[[:space:]]*|deb[[:space:]]+)[^[:space:]]+/debian/?([[:space:]]|$)' \
    /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | head -n 1 | awk '{print $NF}') || true
  echo "${uri:-http://deb.debian.org/debian}"
}

build_base() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "base image $BASE_IMAGE present"
    return 0
  fi
  command -v mmdebstrap >/dev/null 2>&1 || { echo "no mmdebstrap: apt-get install -y mmdebstrap" >&2; return 1; }
  local mirror tarball started
  mirror="${DEBIAN_MIRROR:-$(host_mirror)}"
  tarball=$(mktemp --suffix=.tar)
  started=$(date +%s)
  echo "building $BASE_IMAGE from $mirror (mmdebstrap, bookworm minbase)"
  # python3-venv brings ensurepip; the venv on PATH gives `python` and `pip` as python:*-slim images do,
  # without Debian's externally-managed Python refusing `pip install`
  # this machine's extra CA certificates (an egress proxy's) go in too, so pip and apt inside a build reach
  # the package index as they do here; the image is local to this machine, never pushed
  mmdebstrap --variant=minbase --quiet \
    --include=python3,python3-venv,ca-certificates \
    --customize-hook='mkdir -p "$1"/usr/local/share/ca-certificates' \
    --customize-hook='cp -r /usr/local/share/ca-certificates/. "$1"/usr/local/share/ca-certificates/ 2>/dev/null || true' \
    --customize-hook='chroot "$1" update-ca-certificates >/dev/null' \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
    bookworm "$tarball" "$mirror"
  docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python"]' \
    "$tarball" "$BASE_IMAGE" >/dev/null
  rm -f "$tarball"
  echo "built $BASE_IMAGE in $(($(date +%s) - started)) s"
}

case "${1:-all}" in
  dockerd) start_dockerd ;;
  base) build_base ;;
  all) start_dockerd && build_base ;;
  *) echo "usage: $0 [dockerd|base|all]" >&2; exit 2 ;;
esac
