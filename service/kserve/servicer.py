"""inference.GRPCInferenceService: the Open Inference Protocol (KServe v2) with Triton's extensions, over gRPC.

Triton's clients, dashboards and perf tools speak this protocol; mhaserve answers it on the same port
as encoder.v1. The codec (codec.py) turns a ModelInferRequest into the one internal request and the
answer back; the data plane does the rest, and errors go through the same interceptor and map as
every other method. Version "" means the latest served version; one not served is NOT_FOUND.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc.aio

from mhaserve.proto.inference.v2 import grpc_service_pb2 as pb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from mhaserve.runtime.errors import InvalidArgument, ServiceError
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.kserve.codec import declared, error_pb, from_pb, stream_pb, to_pb
from mhaserve.service.kserve.model import (
    EXTENSIONS,
    model_config,
    model_is_ready,
    model_metadata,
    model_statistics,
    statistics_of,
)
from mhaserve.service.metrics import Metrics, stream_counter
from mhaserve.service.models import ModelManager
from mhaserve.service.rpc.streaming import ordered
from mhaserve.service.version import SERVER_NAME, server_version

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# Methods that answer while the model loads and while the server drains (with false), like grpc.health.v1.
HEALTH_METHODS = tuple(f"/{SERVICE}/{m}" for m in ("ServerLive", "ServerReady", "ModelReady"))
# Triton's repository extension: with API keys configured, these want an admin key.
REPOSITORY_METHODS = tuple(
    f"/{SERVICE}/{m}" for m in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
)


def named(name: str, field: str) -> str:
    """The model a call names: the Open Inference Protocol names it in every call (REST in its path), where an
    empty name here meant the default model, and a client that forgot it got another model's answers."""
    if not name:
        raise InvalidArgument(
            f"no model named: set {field} (the Open Inference Protocol names the model in every call)"
        )
    return name


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The Open Inference Protocol over the data plane."""

    def __init__(self, dataplane: DataPlane, manager: ModelManager, metrics: Metrics | None = None) -> None:
        self.dataplane = dataplane
        self.manager = manager
        self.count_stream = stream_counter(metrics, "inference.GRPCInferenceService/ModelStreamInfer")

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.dataplane.ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        ready = bool(request.name) and model_is_ready(self.dataplane, request.name, request.version)
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=server_version(), extensions=EXTENSIONS)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        pipeline = self.dataplane.resolve(named(request.name, "name"), request.version)
        return model_metadata(pipeline.model, self.dataplane.versions(pipeline.model.name))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        pipeline = self.dataplane.resolve(named(request.name, "name"), request.version)
        return pb.ModelConfigResponse(config=model_config(pipeline))

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        pipelines = statistics_of(self.dataplane, request.name, request.version)
        return pb.ModelStatisticsResponse(model_stats=[model_statistics(p) for p in pipelines])

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        return await self._infer(request, context)

    async def _infer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        pipeline = self.dataplane.resolve(named(request.model_name, "model_name"), request.model_version)
        t0 = time.perf_counter_ns()
        try:
            if (inputs := declared(request)) is not None:
                pipeline.validate_count(inputs)  # before the contents are decoded, row by row
            encode_input = from_pb(request)
        except ServiceError as e:
            pipeline.refused(e, t0)  # at this boundary rather than in the pipeline: still a failed request
            raise
        output = await pipeline.encode(encode_input, time_left=context.time_remaining())
        return to_pb(output, request.id)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        # As encoder.v1's EncodeStream: a failed request gets error_message and the stream goes on.
        async def infer(request: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
            return stream_pb(await self._infer(request, context))

        def share(request: pb.ModelInferRequest) -> float:
            if not request.model_name:  # refused at once (named), as a model not served is
                return 0.0
            try:
                inputs = declared(request) or 0  # (none: refused at once)
            except InvalidArgument:  # too many tensors: refused at once, by their count
                return 0.0
            return self.dataplane.queue_share(inputs, request.model_name, request.model_version)

        serving = self.dataplane.serving  # an UNAVAILABLE ends the stream only once the server takes no calls
        async for response in ordered(
            request_iterator, infer, error_pb, count=self.count_stream, share=share, serving=serving
        ):
            yield response

    # ---- Triton's model repository extension ------------------------------------------------------------

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Context) -> pb.RepositoryIndexResponse:
        entry = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(
            models=[
                entry(name=e.name, version=e.version, state=e.state, reason=e.reason)
                for e in await self.manager.index(ready_only=request.ready)
            ]
        )

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        self.manager.check_control()
        await self.manager.load_model(request.model_name, parameters=list(request.parameters))
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        self.manager.check_control()
        await self.manager.unload_model(request.model_name)
        return pb.RepositoryModelUnloadResponse()
