#!/usr/bin/env bash
# podman for building and running the images on a Debian host without Docker Engine (CI machines, air-gapped
# hosts): the packages, and the engine configuration that machines like ours need. Run as root; .ci/run
# runs it before the tests. Idempotent: what is installed or configured already is left alone.
#
#   podman, runc             the engine, with runc as its OCI runtime (Debian's podman prefers crun, not installed)
#   netavark, aardvark-dns   container networks whose containers find each other by service name (compose)
#   iptables                 netavark's firewall driver: without it no container gets a network
#   debootstrap              deploy/images/base.sh: base images from Debian's packages, without a registry
# podman-compose comes from PyPI with the project's dev extra (`make install-dev`).
set -euo pipefail

packages=(podman runc netavark aardvark-dns iptables debootstrap)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-podman.sh: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Container defaults that fail on such hosts: the default open-file and process limits are above what
# the host lets a process set (runc: "error setting rlimit ... operation not permitted"), and the default
# runtime is crun. A drop-in, so the host's own containers.conf stays as it is.
conf=/etc/containers/containers.conf.d/50-mhaserve.conf
if [ ! -e "$conf" ]; then
  mkdir -p "$(dirname "$conf")"
  cat >"$conf" <<'CONF'
# Written by mhaserve's deploy/images/install-podman.sh.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
CONF
  echo "install-podman.sh: wrote $conf" >&2
fi

podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.NetworkBackend}}' >/dev/null
echo "install-podman.sh: $(podman --version), runtime $(podman info --format '{{.Host.OCIRuntime.Name}}')" >&2
