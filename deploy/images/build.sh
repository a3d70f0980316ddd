#!/usr/bin/env bash
# Build mhaserve's images with docker or podman, whichever answers (`make images` runs this).
#
#   deploy/images/build.sh                      # cpu and loadtest
#   deploy/images/build.sh gpu                  # the CUDA serving image (about 2 GB of pip's CUDA packages)
#   deploy/images/build.sh haproxy prometheus   # the balancer and Prometheus from Debian's packages
#
# Targets and the tags they get (each tag can be set through its variable):
#   cpu         CPU_TAG=mhaserve:cpu             Dockerfile target `cpu`
#   loadtest    LOADTEST_TAG=mhaserve:loadtest   Dockerfile target `loadtest`
#   gpu         GPU_TAG=mhaserve:gpu             Dockerfile target `gpu`
#   haproxy     HAPROXY_TAG=mhaserve-haproxy:bookworm        deploy/haproxy/Containerfile
#   nginx       NGINX_TAG=mhaserve-nginx:bookworm            deploy/nginx/Containerfile
#   prometheus  PROMETHEUS_TAG=mhaserve-prometheus:bookworm  deploy/prometheus/Containerfile
#
# The base images: PYTHON_IMAGE (default docker.io/library/python:3.11-slim) and DEBIAN_IMAGE (default
# docker.io/library/debian:bookworm-slim) when set, present or pullable; otherwise, for hosts without a
# registry, built from Debian's packages by deploy/images/base.sh (needs root and debootstrap).
# pip inside the builds is configured like this host's pip (deploy/images/pip_config.py); HOST_PIP=0 keeps
# the Dockerfile's public defaults instead. BUILD_ARGS adds arguments, e.g. BUILD_ARGS='--build-arg
# EXPORT_ARGS="--optimize --fp16"' or BUILD_ARGS=--no-cache.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=deploy/images/engine.sh
. "$here/engine.sh"

CPU_TAG=${CPU_TAG:-mhaserve:cpu}
LOADTEST_TAG=${LOADTEST_TAG:-mhaserve:loadtest}
GPU_TAG=${GPU_TAG:-mhaserve:gpu}
HAPROXY_TAG=${HAPROXY_TAG:-mhaserve-haproxy:bookworm}
NGINX_TAG=${NGINX_TAG:-mhaserve-nginx:bookworm}
PROMETHEUS_TAG=${PROMETHEUS_TAG:-mhaserve-prometheus:bookworm}
PUBLIC_PYTHON=docker.io/library/python:3.11-slim
PUBLIC_DEBIAN=docker.io/library/debian:bookworm-slim

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(cpu loadtest)

log() { echo "images: $*" >&2; }

# A public base image if it is here or can be pulled, else the Debian-built one (deploy/images/base.sh).
base_image() {
  local public=$1 local_tag=$2
  if image_exists "$public"; then
    echo "$public"
  elif image_exists "$local_tag"; then
    echo "$local_tag"
  elif timeout 300 "$ENGINE" pull -q "$public" >/dev/null 2>&1; then
    echo "$public"
  else
    log "cannot pull $public: building a base from Debian's packages (deploy/images/base.sh)"
    "$here/base.sh" >&2
    echo "$local_tag"
  fi
}

. /etc/os-release
suite=${VERSION_CODENAME:-bookworm}
needs_python=0 needs_debian=0
for t in "${targets[@]}"; do
  case $t in
    cpu | loadtest | gpu) needs_python=1 ;;
    haproxy | nginx | prometheus) needs_debian=1 ;;
    *) echo "images: unknown target $t (cpu, loadtest, gpu, haproxy, nginx, prometheus)" >&2; exit 2 ;;
  esac
done
if [ "$needs_python" = 1 ] && [ -z "${PYTHON_IMAGE:-}" ]; then
  PYTHON_IMAGE=$(base_image "$PUBLIC_PYTHON" "mhaserve-python:$suite")
fi
if [ "$needs_debian" = 1 ] && [ -z "${DEBIAN_IMAGE:-}" ]; then
  DEBIAN_IMAGE=$(base_image "$PUBLIC_DEBIAN" "mhaserve-debian:$suite")
fi

pip_args=()
if [ "$needs_python" = 1 ] && [ "${HOST_PIP:-1}" = 1 ]; then
  mapfile -t pip_args < <(python3 "$here/pip_config.py" --engine "$ENGINE")
fi
extra=()
if [ -n "${BUILD_ARGS:-}" ]; then
  eval "extra=($BUILD_ARGS)"
fi

build() {  # tag, then build arguments
  local tag=$1 start
  shift
  start=$(date +%s)
  log "building $tag with $ENGINE"
  # shellcheck disable=SC2046
  engine build $(build_network_args) $(build_format_args) -t "$tag" "$@" "${extra[@]}"
  log "$tag built in $(($(date +%s) - start)) s"
}

for t in "${targets[@]}"; do
  case $t in
    cpu) build "$CPU_TAG" --target cpu --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" "${pip_args[@]}" "$root" ;;
    loadtest) build "$LOADTEST_TAG" --target loadtest --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" "${pip_args[@]}" "$root" ;;
    gpu) build "$GPU_TAG" --target gpu --build-arg PYTHON_IMAGE="$PYTHON_IMAGE" "${pip_args[@]}" "$root" ;;
    haproxy) build "$HAPROXY_TAG" --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -f "$root/deploy/haproxy/Containerfile" "$root/deploy/haproxy" ;;
    nginx) build "$NGINX_TAG" --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -f "$root/deploy/nginx/Containerfile" "$root/deploy/nginx" ;;
    prometheus) build "$PROMETHEUS_TAG" --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -f "$root/deploy/prometheus/Containerfile" "$root/deploy/prometheus" ;;
  esac
done
