"""The Open Inference Protocol's view of a served model: metadata, Triton's ModelConfig, statistics."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

from mhaserve.proto.inference.v2 import grpc_service_pb2 as pb
from mhaserve.proto.inference.v2 import model_config_pb2 as mc
from mhaserve.runtime.repository import LoadedModel
from mhaserve.service.kserve.tensors import IDS, MASK, OUTPUT, TEXT
from mhaserve.service.pipeline import Pipeline

SERVER_NAME = "mhaserve"
# Triton's names for what this server implements beyond the core protocol.
EXTENSIONS = ("model_configuration", "parameters", "statistics")
PLATFORM = "onnxruntime_onnx"
BACKEND = "onnxruntime"
CONFIG_TYPES = {"BYTES": mc.TYPE_STRING, "INT64": mc.TYPE_INT64, "FP32": mc.TYPE_FP32}


@cache
def server_version() -> str:
    try:
        return package_version("mhaserve")
    except PackageNotFoundError:
        return "unknown"


def tensor_shapes(model: LoadedModel) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the model: datatype and full shape (batch dimension first, -1 for any size)."""
    return {
        TEXT: ("BYTES", [-1]),
        IDS: ("INT64", [-1, -1]),
        MASK: ("INT64", [-1, -1]),
        OUTPUT: ("FP32", [-1, model.entry.manifest.hidden_size]),
    }


def model_metadata(model: LoadedModel, versions: Sequence[int]) -> pb.ModelMetadataResponse:
    """The model's tensors, and every version of it that is served."""
    meta = pb.ModelMetadataResponse.TensorMetadata
    shapes = tensor_shapes(model)
    return pb.ModelMetadataResponse(
        name=model.name,
        versions=[str(v) for v in versions],
        platform=PLATFORM,
        inputs=[meta(name=n, datatype=shapes[n][0], shape=shapes[n][1]) for n in (TEXT, IDS, MASK)],
        outputs=[meta(name=OUTPUT, datatype=shapes[OUTPUT][0], shape=shapes[OUTPUT][1])],
    )


def model_config(pipeline: Pipeline) -> mc.ModelConfig:
    """Triton's view of the model. With max_batch_size > 0, dims leave out the batch dimension."""
    model, limits = pipeline.model, pipeline.limits
    m = model.entry.manifest
    shapes = tensor_shapes(model)
    return mc.ModelConfig(
        name=model.name,
        platform=PLATFORM,
        backend=BACKEND,
        version_policy=mc.ModelVersionPolicy(latest=mc.ModelVersionPolicy.Latest(num_versions=1)),
        max_batch_size=limits.max_client_batch_size,
        # All optional: a request sends text, or input_ids and attention_mask.
        input=[
            mc.ModelInput(name=n, data_type=CONFIG_TYPES[shapes[n][0]], dims=shapes[n][1][1:], optional=True)
            for n in (TEXT, IDS, MASK)
        ],
        output=[mc.ModelOutput(name=OUTPUT, data_type=mc.TYPE_FP32, dims=shapes[OUTPUT][1][1:])],
        dynamic_batching=mc.ModelDynamicBatching(
            max_queue_delay_microseconds=round(limits.max_wait_ms * 1000),
            preserve_ordering=True,
            # mhaserve's queue limit counts inputs (rows), not requests.
            default_queue_policy=mc.ModelQueuePolicy(max_queue_size=limits.max_queue_size),
        ),
        instance_group=[
            mc.ModelInstanceGroup(
                name=model.name,
                kind=mc.ModelInstanceGroup.KIND_GPU if model.on_cuda else mc.ModelInstanceGroup.KIND_CPU,
                count=1,
            )
        ],
        default_model_filename=model.entry.graph_path.name,
        parameters={
            key: mc.ModelParameter(string_value=str(value))
            for key, value in {
                "max_batch_tokens": limits.max_batch_tokens,
                "max_padding": limits.max_padding,
                "max_tokens_per_input": m.max_seq_len,
                "vocab_size": m.vocab_size,
                "pooling": m.pooling,
                "normalize": str(m.normalize).lower(),
                "graph": model.entry.graph,
                "execution_provider": model.provider,
                "sha256": model.entry.sha256,
            }.items()
        },
    )


def model_statistics(pipeline: Pipeline) -> pb.ModelStatistics:
    model = pipeline.model
    s = pipeline.stats.snapshot()

    def duration(d: Any) -> pb.StatisticDuration:
        return pb.StatisticDuration(count=d.count, ns=d.ns)

    return pb.ModelStatistics(
        name=model.name,
        version=str(model.version),
        last_inference=s.last_inference_ms,
        inference_count=s.inference_count,
        execution_count=s.execution_count,
        inference_stats=pb.InferStatistics(
            success=duration(s.success),
            fail=duration(s.fail),
            queue=duration(s.queue),
            compute_input=duration(s.compute_input),
            compute_infer=duration(s.compute_infer),
            compute_output=duration(s.compute_output),
        ),
    )
