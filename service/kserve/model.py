"""The Open Inference Protocol's view of a served model: metadata, Triton's ModelConfig, statistics.

Each is written once, as the JSON the REST API sends (field names as in the .proto files, numbers as
numbers); the gRPC messages are parsed from the same dicts, so the two protocols cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format

from mhaserve.proto.inference.v2 import grpc_service_pb2 as pb
from mhaserve.proto.inference.v2 import model_config_pb2 as mc
from mhaserve.runtime.errors import InvalidArgument, NotFound, Unavailable
from mhaserve.runtime.repository import LoadedModel
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.kserve.tensors import IDS, MASK, OUTPUT, TEXT
from mhaserve.service.pipeline import Pipeline

# Triton's names for what this server implements beyond the core protocol (binary tensor data: REST only,
# as in Triton; the repository methods answer FAILED_PRECONDITION unless --model-control explicit).
EXTENSIONS = ("model_configuration", "parameters", "statistics", "model_repository", "binary_tensor_data")
PLATFORM = "onnxruntime_onnx"
BACKEND = "onnxruntime"
CONFIG_TYPES = {"BYTES": "TYPE_STRING", "INT64": "TYPE_INT64", "FP32": "TYPE_FP32"}


def tensor_shapes(model: LoadedModel) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the model: datatype and full shape (batch dimension first, -1 for any size)."""
    return {
        TEXT: ("BYTES", [-1]),
        IDS: ("INT64", [-1, -1]),
        MASK: ("INT64", [-1, -1]),
        OUTPUT: ("FP32", [-1, model.entry.manifest.hidden_size]),
    }


def metadata(model: LoadedModel, versions: Sequence[int]) -> dict[str, Any]:
    """The model's tensors, and every version of it that is served."""
    shapes = tensor_shapes(model)

    def tensor(name: str) -> dict[str, Any]:
        return {"name": name, "datatype": shapes[name][0], "shape": shapes[name][1]}

    return {
        "name": model.name,
        "versions": [str(v) for v in versions],
        "platform": PLATFORM,
        "inputs": [tensor(n) for n in (TEXT, IDS, MASK)],
        "outputs": [tensor(OUTPUT)],
    }


def config(pipeline: Pipeline) -> dict[str, Any]:
    """Triton's view of the model. With max_batch_size > 0, dims leave out the batch dimension."""
    model, limits = pipeline.model, pipeline.limits
    m = model.entry.manifest
    shapes = tensor_shapes(model)
    parameters = {
        "max_batch_tokens": limits.max_batch_tokens,
        "max_padding": limits.max_padding,
        # what is served: the serving config's overrides, as GetModelInfo and /info report them
        "max_tokens_per_input": model.entry.max_tokens,
        "vocab_size": m.vocab_size,
        "pooling": model.entry.pooling,
        "normalize": str(model.entry.normalize).lower(),
        "graph": model.entry.graph,
        "execution_provider": model.provider,
        "sha256": model.entry.sha256,
    }
    return {
        "name": model.name,
        "platform": PLATFORM,
        "backend": BACKEND,
        "version_policy": pipeline.version_policy.describe(),
        "max_batch_size": limits.max_client_batch_size,
        # All optional: a request sends text, or input_ids and attention_mask.
        "input": [
            {"name": n, "data_type": CONFIG_TYPES[shapes[n][0]], "dims": shapes[n][1][1:], "optional": True}
            for n in (TEXT, IDS, MASK)
        ],
        "output": [{"name": OUTPUT, "data_type": CONFIG_TYPES["FP32"], "dims": shapes[OUTPUT][1][1:]}],
        "dynamic_batching": {
            "max_queue_delay_microseconds": round(limits.max_wait_ms * 1000),
            "preserve_ordering": True,
            # mhaserve's queue limit counts inputs (rows), not requests.
            "default_queue_policy": {"max_queue_size": limits.max_queue_size},
        },
        "instance_group": [{"name": model.name, "kind": "KIND_GPU" if model.on_cuda else "KIND_CPU", "count": 1}],
        "default_model_filename": model.entry.graph_path.name,
        "parameters": {key: {"string_value": str(value)} for key, value in parameters.items()},
    }


def model_is_ready(dataplane: DataPlane, name: str, version: str) -> bool:
    """ModelReady, over either wire. A question, not a command: a model or version not served is simply not
    ready (as in Triton), answered rather than raised into the error map, as it must be while the server
    loads or drains."""
    if not dataplane.ready:
        return False
    try:
        dataplane.resolve(name, version)
    except (NotFound, InvalidArgument, Unavailable):  # Unavailable: it loads
        return False
    return True


def statistics_of(dataplane: DataPlane, name: str, version: str) -> list[Pipeline]:
    """The model versions a statistics request asks for: every one served when it names no model (nor
    version), every served version of a model it names without a version, as Triton answers."""
    if not name and not version:
        return dataplane.pipelines()
    pipeline = dataplane.resolve(name, version)  # NOT_FOUND for a model or version not served
    if version or ":" in name:  # a version named (`name:version` as everywhere else)
        return [pipeline]
    model = pipeline.model.name
    return [dataplane.resolve(model, v) for v in dataplane.versions(model)]


def statistics(pipeline: Pipeline) -> dict[str, Any]:
    """Triton's ModelStatistics: cumulative counts and nanoseconds (clients take differences)."""
    model = pipeline.model
    s = pipeline.stats.snapshot()

    def duration(d: Any) -> dict[str, int]:
        return {"count": d.count, "ns": d.ns}

    return {
        "name": model.name,
        "version": str(model.version),
        "last_inference": s.last_inference_ms,
        "inference_count": s.inference_count,
        "execution_count": s.execution_count,
        "inference_stats": {
            "success": duration(s.success),
            "fail": duration(s.fail),
            "queue": duration(s.queue),
            "compute_input": duration(s.compute_input),
            "compute_infer": duration(s.compute_infer),
            "compute_output": duration(s.compute_output),
            # Triton's response cache's, which we have not (Triton reports them however it runs; perf_analyzer
            # reads them)
            "cache_hit": {"count": 0, "ns": 0},
            "cache_miss": {"count": 0, "ns": 0},
        },
    }


# ---- the same, as the gRPC messages ------------------------------------------------------------------


def model_metadata(model: LoadedModel, versions: Sequence[int]) -> pb.ModelMetadataResponse:
    return json_format.ParseDict(metadata(model, versions), pb.ModelMetadataResponse())


def model_config(pipeline: Pipeline) -> mc.ModelConfig:
    return json_format.ParseDict(config(pipeline), mc.ModelConfig())


def model_statistics(pipeline: Pipeline) -> pb.ModelStatistics:
    return json_format.ParseDict(statistics(pipeline), pb.ModelStatistics())
