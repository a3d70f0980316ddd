#!/usr/bin/env bash
# Builds tests/service/rust_h2 (a gRPC client on Rust's h2 crate, hyper's and so tonic's HTTP/2) into
# tests/service/rust_h2/build/client, offline, from the crates Debian packages under /usr/share/cargo/registry
# (librust-h2-dev, librust-tokio-dev, librust-tokio-rustls-dev, librust-rustls-pemfile-dev, librust-serde-json-dev,
# librust-hex-dev: .ci/run installs them) and
# whichever cargo the machine has (rustup's, or Debian's `cargo`). Where either is missing, says so and builds
# nothing: tests/service/test_rust_h2.py then skips and says why.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build="$here/build"
registry=/usr/share/cargo/registry
cargo=$(command -v cargo || true)
if [ -z "$cargo" ] && [ -x "${HOME:-/root}/.cargo/bin/cargo" ]; then
  cargo="${HOME:-/root}/.cargo/bin/cargo"
fi
if [ -z "$cargo" ]; then
  echo "rust_h2: cargo not found (rustup's, or Debian's cargo): tests/service/test_rust_h2.py will skip" >&2
  exit 0
fi
for crate in h2-0.3 tokio-1 tokio-rustls-0.23 rustls-pemfile-1 serde_json-1 hex-0.4; do
  if ! compgen -G "$registry/$crate.*" >/dev/null; then
    echo "rust_h2: the $crate crate is not under $registry (Debian: librust-h2-dev librust-tokio-dev" \
      "librust-tokio-rustls-dev librust-rustls-pemfile-dev librust-serde-json-dev librust-hex-dev):" \
      "tests/service/test_rust_h2.py will skip" >&2
    exit 0
  fi
done
rm -rf "$build/crate" "$build/client" "$build/.stamp"
mkdir -p "$build/crate" "$build/.cargo"
# Crates come from Debian's registry, never crates.io; cargo reads this from the directory it runs in. The
# crate is built from a copy, so that its Cargo.lock (Debian's versions of the day) stays out of the tree.
printf '[source.crates-io]\nreplace-with = "debian"\n\n[source.debian]\ndirectory = "%s"\n' "$registry" \
  >"$build/.cargo/config.toml"
cp -r "$here/Cargo.toml" "$here/src" "$build/crate/"
# The target folder stays (build/target): a second build recompiles only what changed.
(cd "$build/crate" && "$cargo" build --offline --release --quiet --target-dir "$build/target")
cp "$build/target/release/h2-client" "$build/client"
touch "$build/.stamp"
