"""encoder.v1.EncoderService: protobuf in and out at the edge, the data plane in between."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc
import grpc.aio
import numpy as np

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.runtime.errors import ServiceError
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.errors import to_status
from mhaserve.service.metrics import Metrics, stream_counter
from mhaserve.service.pipeline import EncodeInput, EncodeOutput, Pipeline
from mhaserve.service.rpc.streaming import ordered

Context: TypeAlias = "grpc.aio.ServicerContext[pb.EncodeRequest, pb.EncodeResponse]"
SERVICE = pb.DESCRIPTOR.services_by_name["EncoderService"].full_name


def from_pb(request: pb.EncodeRequest) -> EncodeInput:
    return EncodeInput(
        texts=list(request.texts),
        token_ids=[np.asarray(t.ids, dtype=np.int64) for t in request.token_ids],
        model=request.model,
        version=request.model_version or None,
        truncate=request.truncate if request.HasField("truncate") else None,  # absent: --auto-truncate
        normalize=request.normalize if request.HasField("normalize") else None,
        prompt_name=request.prompt_name or None,
        dimensions=request.dimensions if request.HasField("dimensions") else None,
    )


def to_pb(output: EncodeOutput, packed: bool = False) -> pb.EncodeResponse:
    usage = pb.Usage(input_tokens=output.input_tokens)
    if packed:
        rows = np.ascontiguousarray(output.embeddings, dtype="<f4")
        return pb.EncodeResponse(
            packed=rows.tobytes(),
            dimensions=rows.shape[1],
            model=output.model,
            model_version=output.version,
            usage=usage,
        )
    return pb.EncodeResponse(
        embeddings=[pb.Embedding(values=row) for row in output.embeddings.tolist()],
        model=output.model,
        model_version=output.version,
        usage=usage,
    )


def error_pb(request: pb.EncodeRequest, error: ServiceError) -> pb.EncodeResponse:
    code, message = to_status(error)
    return pb.EncodeResponse(error=pb.Status(code=code.value[0], message=message))


class EncoderServicer(pb_grpc.EncoderServiceServicer):
    """The encoder.v1 API over the data plane."""

    def __init__(self, dataplane: DataPlane, *, max_message_bytes: int, metrics: Metrics | None = None) -> None:
        self.dataplane = dataplane
        self.max_message_bytes = max_message_bytes
        self.count_stream = stream_counter(metrics, "encoder.v1.EncoderService/EncodeStream")

    async def Encode(self, request: pb.EncodeRequest, context: Context) -> pb.EncodeResponse:
        return await self._encode(request, context)

    async def _encode(self, request: pb.EncodeRequest, context: Context) -> pb.EncodeResponse:
        pipeline = self.dataplane.resolve(request.model, request.model_version or None)
        # Counted before the token-id lists become arrays (5 us each: a 4 MB message of 500,000 took 2.5 s).
        pipeline.count_first(len(request.texts) or len(request.token_ids))
        output = await pipeline.encode(from_pb(request), time_left=context.time_remaining())
        return to_pb(output, request.packed)

    async def EncodeStream(
        self, request_iterator: AsyncIterator[pb.EncodeRequest], context: Context
    ) -> AsyncIterator[pb.EncodeResponse]:
        async def encode(request: pb.EncodeRequest) -> pb.EncodeResponse:
            return await self._encode(request, context)

        def share(request: pb.EncodeRequest) -> float:
            inputs = len(request.texts) or len(request.token_ids)
            return self.dataplane.queue_share(inputs, request.model, request.model_version or None)

        serving = self.dataplane.serving  # an UNAVAILABLE ends the stream only once the server takes no calls
        async for response in ordered(
            request_iterator, encode, error_pb, count=self.count_stream, share=share, serving=serving
        ):
            yield response

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> pb.GetModelInfoResponse:
        return self.info(self.dataplane.resolve(request.model, request.model_version or None))

    async def ListModels(self, request: pb.ListModelsRequest, context: Context) -> pb.ListModelsResponse:
        default = self.dataplane.default_model
        ordered = sorted(
            self.dataplane.pipelines(), key=lambda p: (p.model.name != default, p.model.name, -p.model.version)
        )
        return pb.ListModelsResponse(models=[self.info(p) for p in ordered])

    def info(self, pipeline: Pipeline) -> pb.GetModelInfoResponse:
        model = pipeline.model
        entry = model.entry
        m = entry.manifest
        return pb.GetModelInfoResponse(
            name=model.name,
            version=model.version,
            source=m.source,
            dimensions=m.hidden_size,
            max_tokens_per_input=entry.max_tokens,
            pooling=entry.pooling,
            normalize=entry.normalize,
            vocab_size=m.vocab_size,
            layers=m.layers,
            heads=m.heads,
            graph=entry.graph,
            execution_provider=model.provider,
            sha256=entry.sha256,
            max_client_batch_size=pipeline.limits.max_client_batch_size,
            max_batch_tokens=pipeline.limits.max_batch_tokens,
            max_queue_size=pipeline.limits.max_queue_size,
            max_message_bytes=self.max_message_bytes,
            versions=self.dataplane.versions(model.name),
            prompts=entry.prompts,
            default_prompt_name=entry.default_prompt_name or "",
            digest=entry.digest,
        )
