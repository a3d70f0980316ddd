#!/usr/bin/env bash
# podman for building and running the images on a Debian host without Docker Engine (CI machines, air-gapped
# hosts): the packages, and the engine configuration that machines like ours need. Run as root; .ci/run
# runs it before the tests. Idempotent: what is installed or configured already is left alone, except a
# drop-in that an earlier version of this script wrote, which is brought up to date.
#
#   podman, runc             the engine, with runc as its OCI runtime (Debian's podman prefers crun, not installed)
#   netavark, aardvark-dns   container networks whose containers find each other by service name (compose)
#   iptables                 netavark's firewall driver: without it no container gets a network
#   debootstrap              deploy/images/base.sh: base images from Debian's packages, without a registry
# podman-compose comes from PyPI with the project's dev extra (`make install-dev`).
#
#   deploy/images/install-podman.sh                     # packages, configuration, then asks podman
#   deploy/images/install-podman.sh --write-conf FILE   # only the containers.conf drop-in, written to FILE
#                                                       # (any user; tests/deploy/test_podman_conf.py)
set -euo pipefail

# Container defaults that fail or fall short on such hosts, in a drop-in so that the host's own
# containers.conf stays as it is:
# - the default open-file and process limits are above what the host lets a process set (runc: "error
#   setting rlimit ... operation not permitted"), and the default runtime is crun;
# - stop_timeout: podman-compose (1.6) does not pass the compose file's `stop_grace_period: 45s` on. `up`
#   creates containers without --stop-timeout (podman's default, 10 s), and `stop`/`down` pass -t 45 to a
#   service's first replica only; the others, and a plain `podman stop`, get SIGKILL 10 s after SIGTERM,
#   inside the drain (delay 5 s + grace period 30 s). 45 is docker-compose.yml's stop_grace_period.
conf_text() {
  cat <<'CONF'
# Written by mhaserve's deploy/images/install-podman.sh.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
# SIGKILL 45 s after SIGTERM, not 10: podman-compose does not pass the compose file's stop_grace_period.
stop_timeout = 45
CONF
}

# What earlier versions of this script wrote: replaced by the above. A drop-in that is neither (written or
# edited by someone else) is left as it is.
old_conf_text() {
  cat <<'CONF'
# Written by mhaserve's deploy/images/install-podman.sh.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]

[engine]
runtime = "runc"
CONF
}

write_conf() {  # path
  local conf=$1 current
  if [ -e "$conf" ]; then
    current=$(cat "$conf")
    [ "$current" != "$(conf_text)" ] || return 0
    if [ "$current" != "$(old_conf_text)" ]; then
      echo "install-podman.sh: $conf is not what this script writes; leaving it as it is" >&2
      if ! grep -Eq '^[[:space:]]*stop_timeout[[:space:]]*=' "$conf"; then
        echo "install-podman.sh: warning: it sets no stop_timeout: containers that podman-compose starts" \
          "get SIGKILL 10 s after SIGTERM, cutting a drain; add 'stop_timeout = 45' under [engine]" >&2
      fi
      return 0
    fi
  fi
  mkdir -p "$(dirname "$conf")"
  conf_text >"$conf.tmp.$$"
  mv -f "$conf.tmp.$$" "$conf"
  echo "install-podman.sh: wrote $conf" >&2
}

if [ "${1:-}" = --write-conf ]; then
  [ $# -eq 2 ] || { echo "usage: $0 [--write-conf FILE]" >&2; exit 2; }
  write_conf "$2"
  exit 0
fi

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

write_conf /etc/containers/containers.conf.d/50-mhaserve.conf

podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.NetworkBackend}}' >/dev/null
echo "install-podman.sh: $(podman --version), runtime $(podman info --format '{{.Host.OCIRuntime.Name}}')" >&2
