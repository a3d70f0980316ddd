"""encoder.v1.EncoderService: protobuf in and out at the edge, the shared pipeline in between."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias

import grpc
import grpc.aio
import numpy as np

from proto.encoder.v1 import encoder_pb2 as pb
from proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from service.errors import ServiceError, Unavailable, to_status
from service.pipeline import EncodeInput, EncodeOutput, Pipeline

Context: TypeAlias = "grpc.aio.ServicerContext[pb.EncodeRequest, pb.EncodeResponse]"

# Requests of one stream computed at the same time (so they batch together); responses stay in order.
STREAM_WINDOW = 32
# These end a stream with a status; any other failed request gets a response with `error` set.
STREAM_FATAL = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


def from_pb(request: pb.EncodeRequest) -> EncodeInput:
    return EncodeInput(
        texts=list(request.texts),
        token_ids=[np.asarray(t.ids, dtype=np.int64) for t in request.token_ids],
        model=request.model,
        truncate=request.truncate,
        normalize=request.normalize if request.HasField("normalize") else None,
    )


def to_pb(output: EncodeOutput) -> pb.EncodeResponse:
    return pb.EncodeResponse(
        embeddings=[pb.Embedding(values=row) for row in output.embeddings.tolist()],
        model=output.model,
        model_version=output.version,
        usage=pb.Usage(input_tokens=output.input_tokens),
    )


def error_pb(error: ServiceError) -> pb.EncodeResponse:
    code, message = to_status(error)
    return pb.EncodeResponse(error=pb.Status(code=code.value[0], message=message))


class EncoderServicer(pb_grpc.EncoderServiceServicer):
    """The encoder.v1 API. `pipeline()` is None until the model is loaded (the interceptor refuses calls then)."""

    def __init__(self, pipeline: Callable[[], Pipeline | None], *, max_message_bytes: int) -> None:
        self._pipeline = pipeline
        self.max_message_bytes = max_message_bytes

    def pipeline(self) -> Pipeline:
        p = self._pipeline()
        if p is None:
            raise Unavailable("the model is not loaded yet")
        return p

    async def Encode(self, request: pb.EncodeRequest, context: Context) -> pb.EncodeResponse:
        output = await self.pipeline().encode(from_pb(request), time_left=context.time_remaining())
        return to_pb(output)

    async def EncodeStream(
        self, request_iterator: AsyncIterator[pb.EncodeRequest], context: Context
    ) -> AsyncIterator[pb.EncodeResponse]:
        pipeline = self.pipeline()
        pending: asyncio.Queue[asyncio.Task[EncodeOutput] | None] = asyncio.Queue(maxsize=STREAM_WINDOW)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.ensure_future(pipeline.encode(from_pb(request), time_left=context.time_remaining()))
                    await pending.put(task)
            finally:
                await pending.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (task := await pending.get()) is not None:
                try:
                    output = await task
                except ServiceError as e:
                    if e.code in STREAM_FATAL:
                        raise
                    yield error_pb(e)
                else:
                    yield to_pb(output)
            await reader  # re-raises a failure to read the stream
        finally:
            reader.cancel()
            while not pending.empty():
                if (task := pending.get_nowait()) is not None:
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> pb.GetModelInfoResponse:
        pipeline = self.pipeline()
        model = pipeline.resolve(request.model)
        m = model.entry.manifest
        return pb.GetModelInfoResponse(
            name=m.name,
            version=m.version,
            source=m.source,
            dimensions=m.hidden_size,
            max_tokens_per_input=m.max_seq_len,
            pooling=m.pooling,
            normalize=m.normalize,
            vocab_size=m.vocab_size,
            layers=m.layers,
            heads=m.heads,
            graph=model.entry.graph,
            execution_provider=model.provider,
            sha256=model.entry.sha256,
            max_client_batch_size=pipeline.limits.max_client_batch_size,
            max_batch_tokens=pipeline.limits.max_batch_tokens,
            max_queue_size=pipeline.limits.max_queue_size,
            max_message_bytes=self.max_message_bytes,
        )
