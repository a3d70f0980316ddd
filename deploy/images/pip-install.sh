#!/bin/sh
# `pip install ARGS` inside the image builds, through a folder of downloaded files that the build's cache
# mount keeps from one build to the next. pip's own HTTP cache keeps only what servers let it keep (a
# proxy that strips Cache-Control defeats it); files in a folder are reused whatever the headers said.
# What the environment has installed already stays as it is (pinned, and found in the folder), as a
# plain `pip install` would leave it: the export's CPU torch is not replaced by PyPI's CUDA build.
# A CA bundle given to the build as the secret `pip_cert` is pip's (a TLS-intercepting proxy).
set -eu
if [ -s /run/secrets/pip_cert ]; then
  export PIP_CERT=/run/secrets/pip_cert
fi
files=/root/.cache/mhaserve-pip
mkdir -p "$files"
installed=$(mktemp)
pip freeze --exclude-editable | grep -v ' @ ' >"$installed" || true
pip download --quiet --dest "$files" --find-links "$files" --constraint "$installed" "$@"
pip install --no-index --find-links "$files" "$@"
rm -f "$installed"
