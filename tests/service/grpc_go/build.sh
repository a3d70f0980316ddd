#!/usr/bin/env bash
# Builds tests/service/grpc_go/client.go into tests/service/grpc_go/build/client, offline, with Debian's Go
# packages: golang-go, golang-google-grpc-dev (grpc-go), golang-goprotobuf-dev (protoc-gen-go) and
# protobuf-compiler (.ci/run installs them). GOPATH mode, as Debian ships Go libraries under
# /usr/share/gocode: no module download. Where they are missing, says so and builds nothing:
# tests/service/test_grpc_go.py then skips and says why.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build="$here/build"
for tool in go protoc protoc-gen-go; do
  if ! command -v "$tool" >/dev/null; then
    echo "grpc_go: $tool not found (Debian: golang-go golang-google-grpc-dev golang-goprotobuf-dev protobuf-compiler): tests/service/test_grpc_go.py will skip" >&2
    exit 0
  fi
done
if [ ! -d /usr/share/gocode/src/google.golang.org/grpc ]; then
  echo "grpc_go: grpc-go not found under /usr/share/gocode (Debian: golang-google-grpc-dev): tests/service/test_grpc_go.py will skip" >&2
  exit 0
fi
# Go's build cache stays (build/cache): a second build recompiles only what changed.
rm -rf "$build/proto" "$build/src" "$build/client" "$build/.stamp"
mkdir -p "$build/proto/encoder/v1" "$build/src/mhaserve/encoderpb" "$build/src/mhaserve/client"
# Debian's protoc-gen-go (1.3.5) predates proto3's `optional`; a field declared `optional` is, on the wire
# and in presence, a one-field oneof named after it (how protoc itself represents it), which that
# generator knows. Go users with a current protoc-gen-go generate from the proto as it is.
sed -E 's/^( *)optional ([a-z0-9_]+) ([a-z0-9_]+) = ([0-9]+);/\1oneof _\3 { \2 \3 = \4; }/' \
  "$root/proto/encoder/v1/encoder.proto" >"$build/proto/encoder/v1/encoder.proto"
protoc -I "$build/proto" \
  --go_out=plugins=grpc,Mencoder/v1/encoder.proto=mhaserve/encoderpb:"$build/proto" \
  "$build/proto/encoder/v1/encoder.proto"
mv "$build/proto/encoder/v1/encoder.pb.go" "$build/src/mhaserve/encoderpb/"
cp "$here/client.go" "$build/src/mhaserve/client/"
GO111MODULE=off GOFLAGS= GOPATH="$build:/usr/share/gocode" GOCACHE="$build/cache" \
  go build -o "$build/client" mhaserve/client
touch "$build/.stamp"
