"""text-embeddings-inference's gRPC API, tei.v1: protobuf in and out at the edge, the data plane in between.

So that TEI's gRPC clients (stubs made from TEI's proto/tei.proto, grpcurl) work against this server
unchanged: `Embed` and `EmbedStream`, `Info`, `Tokenize`, `Decode` and their streams, as TEI has them.

- One text a request, as TEI's; a stream's requests are computed up to `streaming.WINDOW` at once, so they
  batch together (and with other clients'), and answered in order. A request that fails ends its stream with
  its status, as in TEI (whose responses carry no error field; encoder.v1's stream goes on instead).
- TEI serves one model. Here the default model, or the one a call's `model` metadata names (name, or
  name:version): an extension, as `model` is on TEI's HTTP routes here. An `EmbedStream` is answered by one
  version of it, the one served at its first request (`embed_stream`).
- `truncation_direction` as TEI's: RIGHT (the default) keeps a long input's start, LEFT its end.
- An unset `normalize` is true, as TEI reads it, whatever the model's own default.
- `Metadata`: the text's characters and tokens (its prompt and special tokens included), the call's time in
  the server, and where it went: tokenisation (with the checks before it), the queue, and the model
  (EncodeOutput's times); a unary `Embed` has TEI's timing headers too, as its initial metadata, as TEI's.
- Errors: the one error map's status (service/errors.py) with its message, as on every gRPC method here.
- What this server has no model for (the Predict and Rerank services: classifiers and rerankers; sparse and
  token-level embeddings) is UNIMPLEMENTED, saying what is served.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc
import grpc.aio

from mhaserve.proto.tei.v1 import tei_pb2 as pb
from mhaserve.proto.tei.v1 import tei_pb2_grpc as pb_grpc
from mhaserve.runtime.errors import InvalidArgument, ServiceError, Unavailable, Unimplemented
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.metrics import Metrics, stream_counter
from mhaserve.service.pipeline import EncodeInput, Pipeline
from mhaserve.service.rpc.streaming import ordered
from mhaserve.service.tei_info import tei_info
from mhaserve.service.tei_timing import timing
from mhaserve.service.tokens import tokenize
from mhaserve.service.version import server_version

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
SERVICES = tuple(service.full_name for service in pb.DESCRIPTOR.services_by_name.values())
# What grpc.health.v1 reports for each, as TEI started with an embedding model does (grpc_health_probe
# -service=tei.v1.Embed): the served ones follow the server's readiness; Predict and Rerank (a classifier's, a
# reranker's) are NOT_SERVING.
NOT_SERVED_SERVICES = ("tei.v1.Predict", "tei.v1.Rerank")
SERVED_SERVICES = tuple(name for name in SERVICES if name not in NOT_SERVED_SERVICES)
# The call metadata that names a served model (name, or name:version); absent, the default model.
MODEL_METADATA = "model"
# The truncation directions the enum names (TruncationDirection).
DIRECTIONS = frozenset(pb.TruncationDirection.values())
NOT_SERVED = (
    "this server serves embedding models: tei.v1's Embed, EmbedStream, Info, Tokenize, TokenizeStream, Decode and "
    "DecodeStream; {what} is not served"
)

Request = TypeVar("Request")
Response = TypeVar("Response")


def model_of(context: Context) -> str:
    return next((str(v) for k, v in context.invocation_metadata() or () if k == MODEL_METADATA), "")


def end_stream(request: Any, error: ServiceError) -> Any:
    """A failed request of a stream ends it with its status, as TEI's streams do."""
    raise error


def not_served(what: str) -> Unimplemented:
    return Unimplemented(NOT_SERVED.format(what=what))


async def refused(error: ServiceError) -> AsyncIterator[Any]:
    """A streaming response that ends with `error` before any message: a streaming method's behaviour is an
    async generator, which the interceptors iterate."""
    raise error
    yield  # (unreachable: it makes this an async generator)


class TeiServicer:
    """tei.v1's five services over the data plane; `add_to` puts each on a gRPC server."""

    def __init__(self, dataplane: DataPlane, *, metrics: Metrics | None = None) -> None:
        self.dataplane = dataplane
        self.metrics = metrics

    def add_to(self, server: Any) -> None:
        pb_grpc.add_InfoServicer_to_server(_Info(self), server)
        pb_grpc.add_EmbedServicer_to_server(_Embed(self), server)
        pb_grpc.add_TokenizeServicer_to_server(_Tokenize(self), server)
        pb_grpc.add_PredictServicer_to_server(_Predict(), server)
        pb_grpc.add_RerankServicer_to_server(_Rerank(), server)

    def stream(
        self,
        method: str,
        requests: AsyncIterator[Request],
        compute: Callable[[Request], Awaitable[Response]],
    ) -> AsyncIterator[Response]:
        """A stream's responses, in order (an async generator: a streaming method's behaviour, as the interceptors
        iterate it, may return one rather than be one)."""
        return ordered(requests, compute, end_stream, count=stream_counter(self.metrics, method))

    async def embed_stream(
        self, requests: AsyncIterator[pb.EmbedRequest], context: Context
    ) -> AsyncIterator[pb.EmbedResponse]:
        """EmbedStream's answers, all by one version of the model: the one served at the stream's first request.
        TEI's answers name no version: resolved a request at a time, a version published meanwhile answered the
        requests after it, two embedding spaces in one stream with nothing to tell them apart. Once that version
        is no longer served (retired, or loaded again from changed files), the stream's next request ends it,
        UNAVAILABLE, saying so: held instead, an open stream kept a retired version in memory as long as its
        client liked."""
        pinned: list[Pipeline] = []

        def pipeline() -> Pipeline:
            # Resolved by the first request computed (requests start in order, and this has no await in it)
            if not pinned:
                pinned.append(self.dataplane.resolve(model_of(context)))
            first = pinned[0]
            name, version = first.model.name, first.model.version
            try:
                now = self.dataplane.resolve(name, version)
            except ServiceError:
                now = None
            if now is not first:
                served = ", ".join(map(str, self.dataplane.versions(name))) or "none"
                raise Unavailable(
                    f"model {name!r} version {version}, which answers this stream, is no longer served (versions "
                    f"served: {served}): a stream's answers come from one version; open a new stream"
                )
            return first

        compute = lambda r: self.embed(r, context, pipeline=pipeline)  # noqa: E731
        async for response in self.stream("tei.v1.Embed/EmbedStream", requests, compute):
            yield response

    async def embed(
        self,
        request: pb.EmbedRequest,
        context: Context,
        *,
        headers: bool = False,
        pipeline: Callable[[], Pipeline] | None = None,
    ) -> pb.EmbedResponse:
        """One text's answer, by the model version `pipeline` gives (the model's latest served where None); with
        `headers` (a unary call: a stream's answers share one set of headers), TEI's timing headers too, as the
        call's initial metadata."""
        started = time.perf_counter_ns()
        error = None
        if not request.inputs:  # as TEI refuses it (encoder.v1 embeds an empty text)
            error = InvalidArgument("inputs is an empty string", param="inputs")
        elif request.truncation_direction not in DIRECTIONS:  # proto3 keeps a number its enum does not name
            # it was served as RIGHT; TEI's server fails the call ("Unexpected enum value")
            error = InvalidArgument(
                f"truncation_direction {request.truncation_direction} is none of TRUNCATION_DIRECTION_RIGHT (0) and "
                "TRUNCATION_DIRECTION_LEFT (1)",
                param="truncation_direction",
            )
        if error is not None:
            with contextlib.suppress(ServiceError):  # a failure of the model it names, as the pipeline counts its own
                (self.dataplane.resolve(model_of(context)) if pipeline is None else pipeline()).refused(error, started)
            raise error
        asked = EncodeInput(
            texts=[request.inputs],
            model=model_of(context),
            truncate=request.truncate or None,  # proto3: false is unset, the server's --auto-truncate
            # unset: true, as TEI reads it (and as TEI's HTTP routes here default it), whatever the model's default
            normalize=request.normalize if request.HasField("normalize") else True,
            prompt_name=request.prompt_name if request.HasField("prompt_name") else None,
            dimensions=request.dimensions if request.HasField("dimensions") else None,
            truncate_start=request.truncation_direction == pb.TRUNCATION_DIRECTION_LEFT,
        )
        served = self.dataplane.resolve(asked.model) if pipeline is None else pipeline()
        output = await served.encode(asked, time_left=context.time_remaining())
        total_ns = time.perf_counter_ns() - started
        if headers:
            await context.send_initial_metadata(timing(len(request.inputs), output, total_ns))
        return pb.EmbedResponse(
            embeddings=output.embeddings[0].tolist(),
            metadata=pb.Metadata(
                compute_chars=len(request.inputs),
                compute_tokens=output.input_tokens,
                total_time_ns=total_ns,
                tokenization_time_ns=output.tokenization_ns,
                queue_time_ns=output.queue_ns,
                inference_time_ns=output.inference_ns,
            ),
        )

    def info(self, pipeline: Pipeline) -> pb.InfoResponse:
        info = tei_info(pipeline)
        fields = (
            "model_id",
            "model_sha",
            "model_dtype",
            "max_concurrent_requests",
            "max_input_length",
            "max_batch_tokens",
            "max_client_batch_size",
            "tokenization_workers",
        )
        return pb.InfoResponse(
            version=server_version(), model_type=pb.MODEL_TYPE_EMBEDDING, **{name: info[name] for name in fields}
        )

    async def tokenize(self, request: pb.EncodeRequest, context: Context) -> pb.EncodeResponse:
        pipeline = self.dataplane.resolve(model_of(context))
        return await tokenize(
            pipeline,
            [request.inputs],
            truncate=False,
            prompt_name=request.prompt_name if request.HasField("prompt_name") else None,
            add_special_tokens=request.add_special_tokens,
            render=lambda texts: pb.EncodeResponse(tokens=[pb.SimpleToken(**token) for token in texts[0]]),
            truncatable=False,  # (its EncodeRequest has no truncate)
        )

    async def decode(self, request: pb.DecodeRequest, context: Context) -> pb.DecodeResponse:
        pipeline = self.dataplane.resolve(model_of(context))
        (text,) = await pipeline.decode([list(request.ids)], skip_special_tokens=request.skip_special_tokens)
        return pb.DecodeResponse(text=text)


class _Info(pb_grpc.InfoServicer):
    def __init__(self, tei: TeiServicer) -> None:
        self.tei = tei

    async def Info(self, request: pb.InfoRequest, context: Context) -> pb.InfoResponse:
        return self.tei.info(self.tei.dataplane.resolve(model_of(context)))


class _Embed(pb_grpc.EmbedServicer):
    def __init__(self, tei: TeiServicer) -> None:
        self.tei = tei

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        return await self.tei.embed(request, context, headers=True)

    def EmbedStream(
        self, request_iterator: AsyncIterator[pb.EmbedRequest], context: Context
    ) -> AsyncIterator[pb.EmbedResponse]:
        return self.tei.embed_stream(request_iterator, context)

    async def EmbedSparse(self, request: Any, context: Context) -> Any:
        raise not_served("EmbedSparse (sparse embeddings, a SPLADE model's)")

    def EmbedSparseStream(self, request_iterator: Any, context: Context) -> AsyncIterator[Any]:
        return refused(not_served("EmbedSparseStream (sparse embeddings, a SPLADE model's)"))

    async def EmbedAll(self, request: Any, context: Context) -> Any:
        raise not_served("EmbedAll (each token's embedding)")

    def EmbedAllStream(self, request_iterator: Any, context: Context) -> AsyncIterator[Any]:
        return refused(not_served("EmbedAllStream (each token's embedding)"))


class _Tokenize(pb_grpc.TokenizeServicer):
    def __init__(self, tei: TeiServicer) -> None:
        self.tei = tei

    async def Tokenize(self, request: pb.EncodeRequest, context: Context) -> pb.EncodeResponse:
        return await self.tei.tokenize(request, context)

    def TokenizeStream(
        self, request_iterator: AsyncIterator[pb.EncodeRequest], context: Context
    ) -> AsyncIterator[pb.EncodeResponse]:
        return self.tei.stream(
            "tei.v1.Tokenize/TokenizeStream", request_iterator, lambda r: self.tei.tokenize(r, context)
        )

    async def Decode(self, request: pb.DecodeRequest, context: Context) -> pb.DecodeResponse:
        return await self.tei.decode(request, context)

    def DecodeStream(
        self, request_iterator: AsyncIterator[pb.DecodeRequest], context: Context
    ) -> AsyncIterator[pb.DecodeResponse]:
        return self.tei.stream("tei.v1.Tokenize/DecodeStream", request_iterator, lambda r: self.tei.decode(r, context))


class _Predict(pb_grpc.PredictServicer):
    """A classifier's service: no classifier is served here."""

    async def Predict(self, request: Any, context: Context) -> Any:
        raise not_served("Predict (a classifier's)")

    async def PredictPair(self, request: Any, context: Context) -> Any:
        raise not_served("PredictPair (a classifier's)")

    def PredictStream(self, request_iterator: Any, context: Context) -> AsyncIterator[Any]:
        return refused(not_served("PredictStream (a classifier's)"))

    def PredictPairStream(self, request_iterator: Any, context: Context) -> AsyncIterator[Any]:
        return refused(not_served("PredictPairStream (a classifier's)"))


class _Rerank(pb_grpc.RerankServicer):
    """A reranker's service: no reranker is served here."""

    async def Rerank(self, request: Any, context: Context) -> Any:
        raise not_served("Rerank (a reranker's)")

    async def RerankStream(self, request_iterator: Any, context: Context) -> Any:
        raise not_served("RerankStream (a reranker's)")
