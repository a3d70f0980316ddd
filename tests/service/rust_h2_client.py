"""The gRPC client on Rust's h2 crate (tests/service/rust_h2, built by `make test`): how tests drive it and read
its answers. Used by test_rust_h2.py and, over TLS with rustls, tests/security/test_tls.py."""

from __future__ import annotations

import json
import subprocess
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from tests.service.interop import OK, run_client

BUILD = Path(__file__).resolve().parent / "rust_h2" / "build"
CLIENT = BUILD / "client"
ENCODE, ENCODE_STREAM = "/encoder.v1.EncoderService/Encode", "/encoder.v1.EncoderService/EncodeStream"
CHECK = "/grpc.health.v1.Health/Check"

needs_client = pytest.mark.skipif(
    not (BUILD / ".stamp").is_file(),
    reason="the h2 client is not built (tests/service/rust_h2/build): run the suite with `make test`, with cargo "
    "and Debian's librust-h2-dev, librust-tokio-dev, librust-tokio-rustls-dev, librust-rustls-pemfile-dev, "
    "librust-serde-json-dev and librust-hex-dev installed",
)


def call(path: str, *messages: bytes, copies: int = 1, metadata: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    return {"path": path, "messages": [m.hex() for m in messages], "copies": copies, "metadata": metadata}


def spec(address: str, *rounds: list[dict[str, Any]], **options: Any) -> str:
    """The client's input: the rounds, and `window` or `tls` where given (tests/service/rust_h2/src/main.rs)."""
    return json.dumps({"address": address, "rounds": rounds, **options})


def h2_client(address: str, *rounds: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    """Each round's calls at once on one connection, round after round: what the client printed, in "rounds"
    per round, per call, its answers."""
    return run_client([str(CLIENT)], "the h2 client", stdin=spec(address, *rounds, **options))


def h2_client_fails(address: str, *rounds: list[dict[str, Any]], **options: Any) -> str:
    """The client's error, where it must fail (a TLS handshake refused, say)."""
    proc = subprocess.run(
        [str(CLIENT)], input=spec(address, *rounds, **options), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0, proc.stdout
    return proc.stderr


def status(answer: dict[str, Any]) -> tuple[int, str]:
    """A gRPC answer's status and message: in its trailers, or in its headers alone (Trailers-Only)."""
    assert answer["status"] == 200 and answer["headers"]["content-type"] == "application/grpc", answer
    ending = answer["trailers"] if answer["trailers"] is not None else answer["headers"]
    return int(ending["grpc-status"]), urllib.parse.unquote(ending.get("grpc-message", ""))


def only(answer: dict[str, Any]) -> bytes:
    """The one message of an answer that ended with OK."""
    assert status(answer) == (OK, ""), answer
    assert len(answer["messages"]) == 1, answer
    return bytes.fromhex(answer["messages"][0])
