#!/usr/bin/env bash
# Base images from Debian's own packages, for hosts that cannot pull from an image registry (air-gapped
# sites, or no registry configured): debootstrap builds a minimal Debian root file system from the apt
# mirror this host already uses, the engine imports it, and a short build adds Python.
#
#   deploy/images/base.sh                 # -> mhaserve-debian:bookworm, mhaserve-python:bookworm
#   PYTHON_IMAGE=mhaserve-python:bookworm make images
#
# Needs root (debootstrap), debootstrap, and docker or podman (deploy/images/engine.sh picks one).
# Images that exist already are kept; --force rebuilds them.
#   SUITE   Debian release (default: this host's, from /etc/os-release)
#   MIRROR  Debian mirror (default: the one in this host's apt sources for SUITE)
#   DEBIAN_TAG, PYTHON_TAG  the images' names
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=deploy/images/engine.sh
. "$here/engine.sh"

force=0
[ "${1:-}" = --force ] && force=1

. /etc/os-release
SUITE=${SUITE:-${VERSION_CODENAME:-bookworm}}
DEBIAN_TAG=${DEBIAN_TAG:-mhaserve-debian:$SUITE}
PYTHON_TAG=${PYTHON_TAG:-mhaserve-python:$SUITE}

# The apt sources of this host for SUITE, SUITE-updates and SUITE-security, one "URI SUITE COMPONENTS" a
# line, from deb822 .sources files and one-line .list files alike.
host_sources() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                       uri = $i; suite = $(i + 1); comps = ""; for (j = i + 2; j <= NF; j++) comps = comps " " $j
                       print uri, suite, comps }' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk 'function flush() { if (types ~ /(^| )deb( |$)/ && enabled != "no") { n = split(suites, s, " ");
                              for (k = 1; k <= n; k++) { m = split(uris, u, " "); for (j = 1; j <= m; j++) print u[j], s[k], comps } }
                            types = uris = suites = comps = ""; enabled = "" }
         /^[ \t]*$/ { flush(); next }
         /^#/ { next }
         /^Types:/ { sub(/^Types:[ \t]*/, ""); types = $0 }
         /^URIs:/ { sub(/^URIs:[ \t]*/, ""); uris = $0 }
         /^Suites:/ { sub(/^Suites:[ \t]*/, ""); suites = $0 }
         /^Components:/ { sub(/^Components:[ \t]*/, ""); comps = $0 }
         /^Enabled:/ { sub(/^Enabled:[ \t]*/, ""); enabled = $0 }
         END { flush() }' "$f"
  done | awk -v s="$SUITE" '$2 == s || $2 == s "-updates" || $2 == s "-security"' | sort -u
}

build_debian() {
  local sources mirror rootfs
  sources=$(host_sources)
  mirror=${MIRROR:-$(awk -v s="$SUITE" '$2 == s { print $1; exit }' <<<"$sources")}
  if [ -z "$mirror" ]; then
    echo "base.sh: no apt source for $SUITE on this host; set MIRROR=http://your-mirror/debian" >&2
    exit 1
  fi
  command -v debootstrap >/dev/null || { echo "base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
  rootfs=$(mktemp -d /var/tmp/mhaserve-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' RETURN
  echo "base.sh: debootstrap $SUITE from $mirror" >&2
  debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || {
    tail -n 20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
  rm -f "$rootfs.log"
  # The image's apt reads the same mirrors as this host (main, updates, security when the host has them).
  rm -f "$rootfs/etc/apt/sources.list"
  { if [ -n "$sources" ]; then
      while read -r uri suite comps; do
        printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: %s\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n' \
          "$uri" "$suite" "${comps:-main}"
      done <<<"$sources"
    else
      printf 'Types: deb\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n' \
        "$mirror" "$SUITE"
    fi; } >"$rootfs/etc/apt/sources.list.d/debian.sources"
  # As Debian's -slim images do: no manuals, docs or translations from later installs, no apt caches.
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/01-slim" <<'SLIM'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
SLIM
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$rootfs/etc/apt/apt.conf.d/01-no-recommends"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
         "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/*.log
  find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
  tar --numeric-owner -C "$rootfs" -c . | engine import --change 'CMD ["bash"]' - "$DEBIAN_TAG" >/dev/null
  echo "base.sh: $DEBIAN_TAG" >&2
}

if [ "$force" = 1 ] || ! image_exists "$DEBIAN_TAG"; then
  build_debian
  force=1  # a new Debian image: rebuild Python on it
fi
if [ "$force" = 1 ] || ! image_exists "$PYTHON_TAG"; then
  engine build $(build_network_args) --build-arg DEBIAN_IMAGE="$DEBIAN_TAG" -t "$PYTHON_TAG" \
    -f "$here/python.Containerfile" "$here" >&2
  echo "base.sh: $PYTHON_TAG" >&2
fi
