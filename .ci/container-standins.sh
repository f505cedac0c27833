#!/usr/bin/env bash
# Local stand-ins for the base images docker-compose.yml and deploy/Dockerfile name, for
# the container test (tests/containers/): no image registry is reachable here, so they are
# made from Debian's packages and imported into podman's local store under those names.
#
#   docker.io/library/python:3.12-slim   debootstrap --variant=minbase bookworm with python3,
#                                        python3-venv, python3-pip (Python 3.11: the project
#                                        needs >= 3.11), `python`/`pip` in /usr/local/bin
#   docker.io/library/python:3.12        the same with a C compiler and Python's headers
#                                        (gcc, libc6-dev, python3-dev): deploy/Dockerfile's
#                                        build stage compiles setup.py's modules
#   docker.io/prom/prometheus:v2.54.1    that root file system + Debian's `prometheus`
#                                        (2.42), as the real image: user nobody, /prometheus
#   docker.io/prom/alertmanager:v0.27.0  the same + Debian's `prometheus-alertmanager`
#
# Grafana has no Debian package: it is left out of the CI stack (the dashboards' queries
# are checked against a real Prometheus in tests/e2e/observability/test_observability.py).
#
# Cached: each image carries the label phasewatch.standin=<key>, a hash of this script and
# the Debian package versions; an image with the current key is kept (a warm run takes a
# second), and the root file system tarball is kept under $CACHE so that a wiped podman
# store is refilled without debootstrap. Serialised with flock.
set -euo pipefail

CACHE="${PHASEWATCH_CONTAINERS_CACHE:-$HOME/.cache/phasewatch/containers}"
PYTHON_IMAGE="docker.io/library/python:3.12-slim"
PYTHON_BUILD_IMAGE="docker.io/library/python:3.12"
PROM_IMAGE="docker.io/prom/prometheus:v2.54.1"
AM_IMAGE="docker.io/prom/alertmanager:v0.27.0"

say() { printf '[container-standins %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[container-standins] FAILED: %s\n' "$*" >&2; exit 1; }

command -v podman >/dev/null || die "podman is not installed (apt-get install podman)"
command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9

. /etc/os-release
SUITE="${VERSION_CODENAME:?no VERSION_CODENAME in /etc/os-release}"
# The mirror apt already uses for this release (no host is written down here).
MIRROR="${PHASEWATCH_DEBIAN_MIRROR:-$(apt-get indextargets --format '$(RELEASE) $(REPO_URI)' 'Identifier: Packages' \
  | awk -v s="$SUITE" '$1 == s {print $2; exit}')}"
[ -n "$MIRROR" ] || die "no Debian mirror for $SUITE in apt's configuration (run apt-get update)"

pkg_version() { apt-cache policy "$1" | awk '/Candidate:/ {print $2}'; }
PROM_VERSION=$(pkg_version prometheus)
AM_VERSION=$(pkg_version prometheus-alertmanager)
[ -n "$PROM_VERSION" ] && [ "$PROM_VERSION" != "(none)" ] || die "no prometheus package (apt-get update?)"
[ -n "$AM_VERSION" ] && [ "$AM_VERSION" != "(none)" ] || die "no prometheus-alertmanager package"
KEY=$( { cat "$0"; echo "$SUITE $PROM_VERSION $AM_VERSION"; } | sha256sum | cut -c1-16)
# The debootstrapped root file system depends only on this recipe (edit the version to redo it).
BASE_RECIPE="$SUITE minbase python3,python3-venv,python3-pip,ca-certificates links-v1"
BASE_KEY=$(printf '%s' "$BASE_RECIPE" | sha256sum | cut -c1-16)
BUILD_RECIPE="$BASE_RECIPE gcc,libc6-dev,python3-dev"
BUILD_KEY=$(printf '%s' "$BUILD_RECIPE" | sha256sum | cut -c1-16)

have() {  # have IMAGE: present with the current key
  [ "$(podman image inspect --format '{{ index .Config.Labels "phasewatch.standin" }}' "$1" 2>/dev/null)" = "$KEY" ]
}
if have "$PYTHON_IMAGE" && have "$PYTHON_BUILD_IMAGE" && have "$PROM_IMAGE" && have "$AM_IMAGE"; then
  say "stand-in images present (key $KEY)"
  exit 0
fi

BASE_TAR="$CACHE/python-base-$BASE_KEY.tar"
BUILD_TAR="$CACHE/python-build-$BUILD_KEY.tar"
MON_TAR="$CACHE/monitoring-$KEY.tar"
WORK=$(mktemp -d "$CACHE/work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [ ! -s "$BASE_TAR" ]; then
  say "debootstrap $SUITE (minbase + python3) from $MIRROR (about a minute)"
  rm -f "$CACHE"/python-base-*.tar
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    "$SUITE" "$WORK/root" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
  ln -sf /usr/bin/python3 "$WORK/root/usr/local/bin/python"
  ln -sf /usr/bin/pip3 "$WORK/root/usr/local/bin/pip"
  rm -f "$WORK"/root/usr/lib/python3*/EXTERNALLY-MANAGED
  rm -rf "$WORK"/root/var/cache/apt/archives/*.deb "$WORK"/root/var/lib/apt/lists/*
  tar -C "$WORK/root" -cf "$BASE_TAR.tmp" . && mv "$BASE_TAR.tmp" "$BASE_TAR"
fi
if [ ! -s "$BUILD_TAR" ]; then
  say "debootstrap $SUITE (minbase + python3 + a C compiler) from $MIRROR (a few minutes)"
  rm -f "$CACHE"/python-build-*.tar
  rm -rf "$WORK/build"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python3-dev,gcc,libc6-dev,ca-certificates \
    "$SUITE" "$WORK/build" "$MIRROR" > "$WORK/debootstrap-build.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap-build.log" >&2; die "debootstrap (build) failed"; }
  ln -sf /usr/bin/python3 "$WORK/build/usr/local/bin/python"
  ln -sf /usr/bin/pip3 "$WORK/build/usr/local/bin/pip"
  rm -f "$WORK"/build/usr/lib/python3*/EXTERNALLY-MANAGED
  rm -rf "$WORK"/build/var/cache/apt/archives/*.deb "$WORK"/build/var/lib/apt/lists/*
  tar -C "$WORK/build" -cf "$BUILD_TAR.tmp" . && mv "$BUILD_TAR.tmp" "$BUILD_TAR"
  rm -rf "$WORK/build"
fi
if [ ! -s "$MON_TAR" ]; then
  rm -f "$CACHE"/monitoring-*.tar
  say "adding Debian's prometheus $PROM_VERSION and prometheus-alertmanager $AM_VERSION"
  rm -rf "$WORK/root" && mkdir -p "$WORK/root" "$WORK/debs"
  tar -C "$WORK/root" -xf "$BASE_TAR"
  (cd "$WORK/debs" && apt-get download -q -o APT::Sandbox::User=root "prometheus=$PROM_VERSION" \
      "prometheus-alertmanager=$AM_VERSION" >/dev/null) || die "apt-get download failed"
  # Only their programs (Go binaries needing only libc) and shared files: extracting whole
  # would turn the merged-/usr links (/lib -> usr/lib) into folders and break the loader.
  for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$WORK/ext"; done
  cp -a "$WORK/ext/usr/bin/." "$WORK/root/usr/bin/"
  # and their shared files (Prometheus's web UI, Alertmanager's default.tmpl, without
  # which Debian's Alertmanager fails to load any configuration)
  cp -a "$WORK/ext/usr/share/prometheus" "$WORK/root/usr/share/"
  # As the upstream images: /bin/prometheus and /bin/alertmanager (/bin is /usr/bin here),
  # data folders owned by nobody.
  ln -sf prometheus-alertmanager "$WORK/root/usr/bin/alertmanager"
  mkdir -p "$WORK/root/prometheus" "$WORK/root/alertmanager"
  chown 65534:65534 "$WORK/root/prometheus" "$WORK/root/alertmanager"
  tar -C "$WORK/root" -cf "$MON_TAR.tmp" . && mv "$MON_TAR.tmp" "$MON_TAR"
fi

import() {  # import TAR IMAGE --change ...
  local tar=$1 image=$2; shift 2
  podman rmi -f "$image" >/dev/null 2>&1 || true
  podman import -q --change "LABEL phasewatch.standin=$KEY" "$@" "$tar" "$image" >/dev/null \
    || die "podman import $image failed"
  say "imported $image"
}
import "$BASE_TAR" "$PYTHON_IMAGE" --change 'CMD ["python3"]' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
import "$BUILD_TAR" "$PYTHON_BUILD_IMAGE" --change 'CMD ["python3"]' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
import "$MON_TAR" "$PROM_IMAGE" --change 'ENTRYPOINT ["/bin/prometheus"]' \
  --change 'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]' \
  --change 'USER nobody' --change 'WORKDIR /prometheus' --change 'EXPOSE 9090'
import "$MON_TAR" "$AM_IMAGE" --change 'ENTRYPOINT ["/bin/alertmanager"]' \
  --change 'CMD ["--config.file=/etc/alertmanager/alertmanager.yml", "--storage.path=/alertmanager"]' \
  --change 'USER nobody' --change 'WORKDIR /alertmanager' --change 'EXPOSE 9093'
say "stand-in images ready (key $KEY)"
