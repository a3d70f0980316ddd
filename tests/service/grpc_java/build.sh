#!/usr/bin/env bash
# Builds tests/service/grpc_java/Client.java into tests/service/grpc_java/build/, offline, with Debian's
# Java packages: libgrpc-java (grpc-java on Netty), libprotobuf-java, libnetty-java, libperfmark-java,
# libgeronimo-annotation-1.3-spec-java (the generated stub's @Generated), protobuf-compiler and
# protobuf-compiler-grpc-java-plugin, and a JDK (.ci/run installs what is missing). Where they are
# missing, says so and builds nothing: tests/service/test_grpc_java.py then skips and says why.
# The classpath the client runs with is written to build/classpath.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build="$here/build"
jars=/usr/share/java
needed=(grpc-api grpc-context grpc-core grpc-netty grpc-protobuf grpc-protobuf-lite grpc-stub protobuf guava
  netty-buffer netty-codec netty-codec-http netty-codec-http2 netty-codec-socks netty-common netty-handler
  netty-handler-proxy netty-resolver netty-transport jsr305 error_prone_annotations opencensus-api perfmark-api
  geronimo-annotation-1.3-spec)
skip() {
  echo "grpc_java: $1 not found (Debian: libgrpc-java libprotobuf-java libnetty-java libperfmark-java libgeronimo-annotation-1.3-spec-java protobuf-compiler protobuf-compiler-grpc-java-plugin default-jdk-headless): tests/service/test_grpc_java.py will skip" >&2
  exit 0
}
for tool in javac java protoc grpc_java_plugin; do
  command -v "$tool" >/dev/null || skip "$tool"
done
classpath=""
for jar in "${needed[@]}"; do
  [ -f "$jars/$jar.jar" ] || skip "$jars/$jar.jar"
  classpath="$classpath${classpath:+:}$jars/$jar.jar"
done
rm -rf "$build"
mkdir -p "$build/gen" "$build/classes"
protoc -I "$root/proto" --java_out="$build/gen" \
  --plugin=protoc-gen-grpc-java="$(command -v grpc_java_plugin)" --grpc-java_out="$build/gen" \
  "$root/proto/encoder/v1/encoder.proto"
# -nowarn: the generated code uses APIs newer JDKs mark deprecated; the client's own code is small.
javac -nowarn -d "$build/classes" -cp "$classpath" $(find "$build/gen" -name '*.java') "$here/Client.java"
echo "$build/classes:$classpath" >"$build/classpath"
touch "$build/.stamp"
