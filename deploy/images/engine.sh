# shellcheck shell=bash
# Sourced by the scripts beside it: which container engine to use, and a few helpers over it.
#
# CONTAINER_ENGINE=docker|podman picks one; otherwise docker if its engine answers, else podman if it
# answers. A `docker` client with no daemon behind it (common on CI machines and laptops with podman) is
# not an engine: `docker info` must succeed.

pick_engine() {
  if [ -n "${CONTAINER_ENGINE:-}" ]; then
    echo "$CONTAINER_ENGINE"
    return 0
  fi
  local e
  for e in docker podman; do
    if command -v "$e" >/dev/null 2>&1 && timeout 20 "$e" info >/dev/null 2>&1; then
      echo "$e"
      return 0
    fi
  done
  echo "no container engine answers: neither \`docker info\` nor \`podman info\` succeeds" \
       "(Debian: apt-get install --no-install-recommends podman runc netavark aardvark-dns; see docs/deploy.md)" >&2
  return 1
}

ENGINE=${ENGINE:-$(pick_engine)}

engine() { "$ENGINE" "$@"; }

image_exists() {
  engine image inspect "$1" >/dev/null 2>&1
}

# Builds on the host's network: the pip indexes, apt mirrors and proxies this host reaches. podman only:
# BuildKit (docker) runs builds on its own network, which reaches what the daemon reaches.
build_network_args() {
  if [ "$ENGINE" = podman ]; then
    echo "--network host"
  fi
}

# podman keeps HEALTHCHECK (and other Docker-only instructions) only in Docker's image format.
build_format_args() {
  if [ "$ENGINE" = podman ]; then
    echo "--format docker"
  fi
}
