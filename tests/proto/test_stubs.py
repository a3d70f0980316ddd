"""The committed gRPC stubs are exactly what `make proto` generates from the committed .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted(p.relative_to(ROOT) for p in (ROOT / "proto").rglob("*.proto"))
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def test_there_are_protos() -> None:
    assert Path("proto/encoder/v1/encoder.proto") in PROTOS
    assert Path("proto/inference/v2/grpc_service.proto") in PROTOS
    assert Path("proto/inference/v2/model_config.proto") in PROTOS


@pytest.mark.parametrize("proto", PROTOS, ids=str)
def test_committed_stubs_match_the_proto(proto: Path, tmp_path: Path) -> None:
    # The Makefile's own recipe (protoc, then the imports rewritten to mhaserve.proto), into a scratch directory.
    subprocess.run(
        ["make", "--no-print-directory", "proto-generate", f"PROTO_OUT={tmp_path}", f"PY={sys.executable}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    stem = str(proto.with_suffix(""))
    for suffix in SUFFIXES:
        generated = (tmp_path / (stem + suffix)).read_bytes()
        committed = ROOT / (stem + suffix)
        assert committed.is_file(), f"{committed} is missing: run `make proto` and commit it"
        assert committed.read_bytes() == generated, f"{committed} differs from {proto}: run `make proto` and commit it"


def test_no_stubs_without_a_proto() -> None:
    stubs = {p for s in SUFFIXES for p in (ROOT / "proto").rglob("*" + s)}
    orphans = [
        p for p in stubs if not any(str(p).endswith(str(q.with_suffix("")) + s) for q in PROTOS for s in SUFFIXES)
    ]
    assert not orphans, f"stubs with no .proto: {orphans}"
