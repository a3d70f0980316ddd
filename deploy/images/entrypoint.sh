#!/bin/sh
# The serving images' entry point: `mhaserve serve` with the container's arguments, which are its options
# (`docker run IMAGE --graph int8`), as when the entry point was `mhaserve serve` itself.
#
# Amazon SageMaker's hosting contract starts a container as `docker run IMAGE serve`, and mhaserve serve
# would refuse `serve` as an unknown argument. So a first argument `serve` is read as that contract
# (docs/deploy.md, "Amazon SageMaker"), and under it:
# - the model SageMaker unpacked from ModelDataUrl into /opt/ml/model is served, where there is one, in place
#   of the image's own /models (a model repository: <name>/<version>/ folders, as `mhaserve export` writes);
#   a MHASERVE_REPOSITORY set to another folder than the image's still wins;
# - the HTTP API listens on SAGEMAKER_BIND_TO_PORT where SageMaker sets it (the containers of an inference
#   pipeline share the host's ports), else on 8080, the image's HTTP port already; and gRPC and the metrics
#   take the first two ports of SAGEMAKER_SAFE_PORT_RANGE ("29000-29999"), the range SageMaker keeps for a
#   container's other ports, where it sets one, in place of the image's 50051 and 8000;
# - in-flight calls get 20 s to finish on SIGTERM unless MHASERVE_GRACE_PERIOD says otherwise: SageMaker
#   sends SIGKILL 30 s after SIGTERM, and the image's drain delay (5 s) comes first;
# - a request may be 6 MiB unless MHASERVE_MAX_MESSAGE_BYTES says otherwise, in place of the server's 4 MiB:
#   SageMaker passes on up to 6 MB, InvokeEndpoint's limit and a batch transform's default MaxPayloadInMB, so
#   a body SageMaker accepted was a 413 from the server.
# `exec`, so that the server is the container's pid 1 and gets SageMaker's (and docker's) SIGTERM itself.
#
# A first argument `healthcheck` is the image's HEALTHCHECK: `mhaserve health` on the gRPC port the server
# listens on, the rest of the arguments its options (`--tls-ca ...`). Docker runs the check as a process of its
# own, with the image's environment and not what this script exported to the server, so the port is worked out
# here again the same way: under SageMaker's range, the check asked 50051 while the server listened on 29000.
# A `--port` among the container's arguments (`docker run IMAGE --port 6000`) is read from the server's own
# command line, pid 1's, since it wins over MHASERVE_PORT there: without it the check asked 50051, and
# Docker marked a serving container unhealthy (and an orchestrator that acts on that restarted it).
set -eu

SAGEMAKER_MODEL=/opt/ml/model

# SageMaker's ports in place of the image's own (see above); a port set explicitly is kept.
sagemaker_ports() {
    if [ -n "${SAGEMAKER_BIND_TO_PORT:-}" ]; then
        export MHASERVE_HTTP_PORT="$SAGEMAKER_BIND_TO_PORT"
    fi
    if [ -n "${SAGEMAKER_SAFE_PORT_RANGE:-}" ]; then
        first=${SAGEMAKER_SAFE_PORT_RANGE%%-*}
        if [ "${MHASERVE_PORT:-50051}" = 50051 ]; then
            export MHASERVE_PORT="$first"
        fi
        if [ "${MHASERVE_METRICS_PORT:-8000}" = 8000 ]; then
            export MHASERVE_METRICS_PORT=$((first + 1))
        fi
    fi
}

# The gRPC port among the options on pid 1's command line (`--port N` or `--port=N`; the last one wins, as in
# argparse) when pid 1 is `mhaserve serve`, which this script execs: `<python> <venv>/bin/mhaserve serve ...`.
# Prints nothing otherwise. Only the check's tests point _MHASERVE_SERVER_CMDLINE at another file.
server_port_option() {
    cmdline=${_MHASERVE_SERVER_CMDLINE:-/proc/1/cmdline}
    [ -r "$cmdline" ] || return 0
    tr '\000' '\n' <"$cmdline" | awk '
        serving && want { port = $0; want = 0; next }
        serving && $0 == "--port" { want = 1; next }
        serving && index($0, "--port=") == 1 { port = substr($0, 8); next }
        serving { next }
        after_mhaserve && $0 == "serve" { serving = 1; next }
        { after_mhaserve = ($0 ~ /(^|\/)mhaserve$/) }
        END { if (port != "") print port }
    '
}

case "${1:-}" in
    serve)
        shift
        if [ "${MHASERVE_REPOSITORY:-/models}" = /models ] && [ -d "$SAGEMAKER_MODEL" ] \
            && [ -n "$(ls -A "$SAGEMAKER_MODEL")" ]; then
            export MHASERVE_REPOSITORY="$SAGEMAKER_MODEL"
        fi
        sagemaker_ports
        export MHASERVE_GRACE_PERIOD="${MHASERVE_GRACE_PERIOD:-20}"
        export MHASERVE_MAX_MESSAGE_BYTES="${MHASERVE_MAX_MESSAGE_BYTES:-6291456}"
        ;;
    healthcheck)
        shift
        # Only SageMaker sets its range, and it always starts the container with `serve`.
        sagemaker_ports
        port=$(server_port_option)
        exec mhaserve health --address "127.0.0.1:${port:-${MHASERVE_PORT:-50051}}" "$@"
        ;;
esac

exec mhaserve serve "$@"
