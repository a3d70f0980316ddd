"""Triton's own clients against a real mhaserve: the Open Inference Protocol's interoperability promise,
over gRPC (tritonclient.grpc) and HTTP (tritonclient.http, with its binary tensor data by default).

tritonclient pins protobuf < 7 and mhaserve's stubs need protobuf >= 7, so the client runs in a venv of
its own (.venv-triton, made by `make test`) as a subprocess: tests/kserve/triton_client.py drives
live/ready/metadata/config/statistics/infer/stream and prints JSON, which these tests compare with what
encoder.v1's Encode returns for the same inputs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2, model_config_pb2
from mhaserve.runtime.manifest import read_manifest
from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.service.settings import Settings
from mhaserve.testing.loopback import free_port
from mhaserve.testing.server import ServerThread
from tests.kserve.triton_client import describe_file

ROOT = Path(__file__).resolve().parents[2]
TRITON_VENV = ROOT / ".venv-triton"
SCRIPT = ROOT / "tests" / "kserve" / "triton_client.py"
CALL_TIMEOUT = 180.0  # the whole client script: tritonclient's import and a dozen calls
TEXTS = ["a", "hello world", "héllo wörld 🤖", "", "the quick brown fox jumps over the lazy dog " * 3]

pytestmark = pytest.mark.skipif(
    not (TRITON_VENV / ".stamp").is_file(),
    reason="Triton's client venv (.venv-triton) is missing: run the suite with `make test`, which creates it",
)


def triton(command: str, spec: dict[str, Any] | None = None) -> Any:
    """Run the client script under .venv-triton and parse what it prints."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(TRITON_VENV / "bin" / "python"), str(SCRIPT), command],
        input=json.dumps(spec or {}),
        capture_output=True,
        text=True,
        timeout=CALL_TIMEOUT,
        env=env,
    )
    assert proc.returncode == 0, f"triton_client.py {command} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def padded(rows: list[list[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Rows padded on the right to the longest, and their attention mask."""
    width = max(len(r) for r in rows)
    return [r + [pad_id] * (width - len(r)) for r in rows], [[1] * len(r) + [0] * (width - len(r)) for r in rows]


def vectors(response: pb.EncodeResponse) -> npt.NDArray[np.float32]:
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


def assert_close(got: dict[str, Any], expected: npt.NDArray[np.float32]) -> None:
    array = np.array(got["embeddings"], dtype=np.float32)
    assert array.shape == expected.shape
    assert np.abs(array - expected).max() <= 1e-5


@dataclasses.dataclass
class Interop:
    """One client run against one server, and Encode's answers for the same inputs."""

    results: dict[str, Any]
    http: dict[str, Any]  # the same through tritonclient.http
    encoded: npt.NDArray[np.float32]  # texts, the model's default normalisation
    encoded_raw: npt.NDArray[np.float32]  # texts, not normalised
    encoded_dims: npt.NDArray[np.float32]  # texts, their first 8 dimensions renormalised
    encoded_ids: npt.NDArray[np.float32]  # the texts' token ids, unpadded
    tokens: list[list[int]]
    server: ServerThread


def interop(server: ServerThread, entry: Path, texts: list[str]) -> Interop:
    manifest = read_manifest(entry)
    tokenizer = load_for_serving(entry / "tokenizer.json", manifest.max_seq_len)
    tokens = [tokenizer.encode(t).ids for t in texts]
    ids, mask = padded(tokens, manifest.pad_id)
    spec = {"url": server.address, "model": manifest.name, "texts": texts, "ids": ids, "mask": mask}
    results = triton("run", spec)
    http = triton("run_http", spec | {"url": server.http_url.removeprefix("http://")})
    with server.channel() as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        encoded = vectors(stub.Encode(pb.EncodeRequest(texts=texts), timeout=30))
        encoded_raw = vectors(stub.Encode(pb.EncodeRequest(texts=texts, normalize=False), timeout=30))
        encoded_dims = vectors(stub.Encode(pb.EncodeRequest(texts=texts, dimensions=8), timeout=30))
        by_ids = pb.EncodeRequest(token_ids=[pb.TokenIds(ids=r) for r in tokens])
        encoded_ids = vectors(stub.Encode(by_ids, timeout=30))
    return Interop(results, http, encoded, encoded_raw, encoded_dims, encoded_ids, tokens, server)


@pytest.fixture(scope="module")
def tiny(tiny_repo: Path, tiny_entry: Path, grpc_front: str) -> Iterator[Interop]:
    settings = Settings(
        repository=tiny_repo,
        port=0,
        metrics_port=0,
        http_port=free_port(),
        device="cpu",
        intra_op_threads=1,
        grpc_front=grpc_front,
    )
    server = ServerThread(settings).ready()
    try:
        yield interop(server, tiny_entry, TEXTS)
    finally:
        server.stop()


def test_health_and_server_metadata(tiny: Interop) -> None:
    r = tiny.results
    assert (r["live"], r["ready"], r["model_ready"], r["model_ready_missing"]) == (True, True, True, False)
    assert r["server_metadata"]["name"] == "mhaserve"
    assert {"model_configuration", "statistics"} <= set(r["server_metadata"]["extensions"])


def test_model_metadata(tiny: Interop) -> None:
    meta = tiny.results["model_metadata"]
    assert (meta["name"], meta["versions"], meta["platform"]) == ("tiny", ["1"], "onnxruntime_onnx")
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]}
    # as_json renders int64 as strings (the protobuf JSON mapping).
    assert inputs == {
        "text": ("BYTES", ["-1"]),
        "input_ids": ("INT64", ["-1", "-1"]),
        "attention_mask": ("INT64", ["-1", "-1"]),
    }
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["outputs"]] == [("embeddings", "FP32", ["-1", "32"])]


def test_model_config_parses_with_tritons_own_definition(tiny: Interop) -> None:
    config = tiny.results["model_config"]["config"]
    assert config["name"] == "tiny" and config["max_batch_size"] == 2048  # the default inputs per request
    assert config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnxruntime"
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "2000"
    assert config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 8192
    assert {i["name"]: (i["data_type"], i.get("dims", [])) for i in config["input"]} == {
        "text": ("TYPE_STRING", []),
        "input_ids": ("TYPE_INT64", ["-1"]),
        "attention_mask": ("TYPE_INT64", ["-1"]),
    }
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [("embeddings", "TYPE_FP32", ["32"])]
    assert config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["parameters"]["max_tokens_per_input"]["string_value"] == "160"


def test_infer_equals_encode(tiny: Interop) -> None:
    r = tiny.results
    assert_close(r["infer_text"], tiny.encoded)
    assert_close(r["infer_text_raw"], tiny.encoded_raw)  # the `normalize` parameter
    assert_close(r["infer_text_dims"], tiny.encoded_dims)  # the `dimensions` parameter (int64_param)
    assert r["infer_text_dims"]["shape"] == [len(TEXTS), 8]
    assert_close(r["infer_ids"], tiny.encoded_ids)  # padded rows, stripped by the mask
    assert_close(r["infer_after_errors"], tiny.encoded)
    text = r["infer_text"]
    assert (text["datatype"], text["shape"], text["model_name"], text["model_version"], text["id"]) == (
        "FP32",
        [len(TEXTS), 32],
        "tiny",
        "1",
        "text-1",
    )
    assert text["input_tokens"] == sum(len(t) for t in tiny.tokens)


def test_stream_infer_equals_encode_and_reports_a_bad_request(tiny: Interop) -> None:
    stream = tiny.results["stream"]
    for i in range(len(TEXTS)):
        assert_close(stream[f"stream-{i}"], tiny.encoded[i : i + 1])
        assert stream[f"stream-{i}"]["final"] is True  # as Triton marks each answer of a model not decoupled
    assert "INVALID_ARGUMENT" in stream["error"] and "unknown input 'nope'" in stream["error"]


def test_errors_have_the_encode_status_codes(tiny: Interop) -> None:
    errors = tiny.results["errors"]
    assert errors["wrong_datatype"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "datatype INT32; expected INT64" in errors["wrong_datatype"]["message"]
    assert errors["missing_input"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "missing input 'attention_mask'" in errors["missing_input"]["message"]
    # `dimensions` as Encode reads it: 1 to the model's 32, and an integer (int64_param), not a string
    assert errors["dimensions_too_many"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "ask for 1 to 32" in errors["dimensions_too_many"]["message"]
    assert errors["dimensions_not_int"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert (
        "parameter 'dimensions' must be an integer (int64_param), got string_param"
        in (errors["dimensions_not_int"]["message"])
    )
    for case in ("unknown_model", "unknown_version", "metadata_unknown_model"):
        assert errors[case]["status"] == "StatusCode.NOT_FOUND", case
    # set_shared_memory on an input or an output: refused, not answered inline (the client would read its region)
    for case, tensor in (("shared_memory_input", "input 'text'"), ("shared_memory_output", "output 'embeddings'")):
        assert errors[case]["status"] == "StatusCode.INVALID_ARGUMENT", case
        assert f"{tensor} sets shared_memory_region: shared memory is not supported" in errors[case]["message"]


def test_statistics_count_what_the_client_did(tiny: Interop) -> None:
    def stats(key: str) -> dict[str, Any]:
        (model,) = tiny.results[key]["model_stats"]
        assert (model["name"], model["version"]) == ("tiny", "1")
        return model

    before, after = stats("statistics_before"), stats("statistics_after")

    def count(model: dict[str, Any], *path: str) -> int:
        value: Any = model
        for key in path:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        return int(value or 0)  # as_json leaves zero fields out and renders uint64 as strings

    def delta(*path: str) -> int:
        return count(after, *path) - count(before, *path)

    # 5 infers and 5 stream requests succeeded; the wrong datatype, the two bad `dimensions`, the missing input,
    # the two in shared memory and the stream's bad request failed (requests for other models or versions are
    # not this model's).
    assert delta("inference_stats", "success", "count") == 10
    assert delta("inference_stats", "fail", "count") == 7
    assert delta("inference_count") == 5 * len(TEXTS) + len(TEXTS)
    assert delta("execution_count") > 0
    for part in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert delta("inference_stats", part, "ns") > 0, part
    assert int(after["last_inference"]) > 0


def test_our_proto_is_wire_compatible_with_tritonclients_copy() -> None:
    """Every message, field (name, number, type) and method of ours exists as such in tritonclient's."""
    reference = triton("describe")

    ours: dict[str, Any] = {}
    for file in (grpc_service_pb2.DESCRIPTOR, model_config_pb2.DESCRIPTOR):
        ours.update(describe_file(file))
    assert ours, "nothing to compare"
    for name, fields in ours.items():
        assert name in reference, f"{name} is not in Triton's protocol"
        for field, spec in fields.items():
            theirs = reference[name].get(field)
            assert theirs == spec, f"{name}.{field}: ours {spec}, Triton's {theirs}"


@pytest.mark.slow
def test_minilm_through_tritonclient_equals_encode(minilm_entry: Path) -> None:
    """The README's set-up: all-minilm-l6-v2, text in as BYTES, through Triton's client."""
    settings = Settings(
        repository=minilm_entry.parent.parent, port=0, metrics_port=0, http_port=free_port(), device="cpu"
    )
    server = ServerThread(settings).ready()
    try:
        texts = ["The quick brown fox jumps over the lazy dog.", "Une phrase en français.", "emoji 🤖", ""]
        run = interop(server, minilm_entry, texts)
    finally:
        server.stop()
    assert_close(run.results["infer_text"], run.encoded)
    assert_close(run.results["infer_ids"], run.encoded_ids)
    assert run.results["infer_text"]["shape"] == [len(texts), 384]
    assert_close(run.http["infer_text"], run.encoded)
    assert_close(run.http["infer_ids"], run.encoded_ids)


# ---- the same through tritonclient.http -------------------------------------------------------------


def test_http_health_metadata_and_config(tiny: Interop) -> None:
    r = tiny.http
    assert (r["live"], r["ready"], r["model_ready"], r["model_ready_missing"]) == (True, True, True, False)
    assert r["server_metadata"]["name"] == "mhaserve"
    assert {"model_configuration", "statistics"} <= set(r["server_metadata"]["extensions"])
    meta = r["model_metadata"]
    assert (meta["name"], meta["versions"], meta["platform"]) == ("tiny", ["1"], "onnxruntime_onnx")
    assert {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]} == {
        "text": ("BYTES", [-1]),
        "input_ids": ("INT64", [-1, -1]),
        "attention_mask": ("INT64", [-1, -1]),
    }
    assert [(t["name"], t["shape"]) for t in meta["outputs"]] == [("embeddings", [-1, 32])]
    config = r["model_config"]
    assert (config["name"], config["max_batch_size"], config["backend"]) == ("tiny", 2048, "onnxruntime")
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    # the gRPC and the REST views are one: the same config, field for field
    grpc_config = tiny.results["model_config"]["config"]
    assert grpc_config["parameters"] == config["parameters"]


def test_http_infer_equals_encode_in_binary_and_json(tiny: Interop) -> None:
    r = tiny.http
    assert r["infer_text"]["binary"] and not r["infer_text_json"]["binary"]
    assert_close(r["infer_text"], tiny.encoded)
    assert_close(r["infer_text_json"], tiny.encoded)
    assert_close(r["infer_text_raw"], tiny.encoded_raw)  # the `normalize` parameter
    assert_close(r["infer_text_dims"], tiny.encoded_dims)  # the `dimensions` parameter (a JSON integer)
    assert_close(r["infer_ids"], tiny.encoded_ids)  # binary INT64 inputs, padding stripped by the mask
    assert_close(r["infer_ids_json"], tiny.encoded_ids)  # nested JSON INT64 data
    assert_close(r["infer_gzip"], tiny.encoded)  # a gzip request body
    assert_close(r["infer_after_errors"], tiny.encoded)
    text = r["infer_text"]
    assert (text["model_name"], text["model_version"], text["id"]) == ("tiny", "1", "http-1")
    assert text["input_tokens"] == sum(len(t) for t in tiny.tokens)
    # the same numbers as tritonclient.grpc got
    assert np.array_equal(np.array(text["embeddings"]), np.array(tiny.results["infer_text"]["embeddings"]))


def test_http_errors_have_the_mapped_statuses(tiny: Interop) -> None:
    errors = tiny.http["errors"]
    assert errors["wrong_datatype"]["status"] == "400"
    assert "datatype INT32; expected INT64" in errors["wrong_datatype"]["message"]
    assert errors["missing_input"]["status"] == "400"
    assert "missing input 'attention_mask'" in errors["missing_input"]["message"]
    assert errors["dimensions_too_many"]["status"] == "400"
    assert "ask for 1 to 32" in errors["dimensions_too_many"]["message"]
    assert errors["dimensions_not_int"]["status"] == "400"  # JSON true is no integer, though Python's bool is one
    assert "parameter 'dimensions' must be an integer, got bool" in errors["dimensions_not_int"]["message"]
    for case in ("unknown_model", "unknown_version", "metadata_unknown_model"):
        assert errors[case]["status"] == "404", case
    for case, tensor in (("shared_memory_input", "input 'text'"), ("shared_memory_output", "output 'embeddings'")):
        assert errors[case]["status"] == "400", case
        assert f"{tensor} sets shared_memory_region: shared memory is not supported" in errors[case]["message"]


def test_http_statistics_count_what_the_client_did(tiny: Interop) -> None:
    (before,) = tiny.http["statistics_before"]["model_stats"]
    (after,) = tiny.http["statistics_after"]["model_stats"]
    # 8 infers succeeded; the wrong datatype, the two bad `dimensions`, the missing input and the two in shared
    # memory failed.
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 8
    assert after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 6
    assert after["inference_count"] - before["inference_count"] == 8 * len(TEXTS)
