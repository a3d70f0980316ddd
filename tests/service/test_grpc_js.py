"""Node's gRPC client (@grpc/grpc-js, on Node's own HTTP/2: nghttp2) against the server, on each gRPC front.

grpcio's clients speak grpc core's HTTP/2, and grpclib hyper-h2's (test_server.py); grpc-js is the client
JavaScript users have, on a third implementation. Its packages are installed by `make test` from
tests/service/grpc_js/package-lock.json; tests/service/grpc_js/client.js makes the calls and prints JSON.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mhaserve.testing.server import ServerThread
from tests.service.interop import TEXTS, assert_answered_as_grpcio_was, grpcio_answer, run_client

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "tests" / "service" / "grpc_js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(
    NODE is None or not (CLIENT / "node_modules" / ".stamp").is_file(),
    reason="grpc-js is not installed (tests/service/grpc_js/node_modules): run the suite with `make test`",
)


def grpc_js(address: str, texts: list[str]) -> Any:
    assert NODE is not None
    return run_client([NODE, str(CLIENT / "client.js"), address, str(ROOT / "proto"), json.dumps(texts)], "client.js")


def test_grpc_js_encodes_as_grpcio_does_and_reads_errors_and_streams(server: ServerThread) -> None:
    want = grpcio_answer(server)
    got = grpc_js(server.address, TEXTS)
    assert_answered_as_grpcio_was(got, want, message="details")
