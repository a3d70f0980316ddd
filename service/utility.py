"""The utility routes users of text-embeddings-inference expect: `POST /tokenize`, `POST /decode`, `GET /info`,
`GET /health` (and `GET /ping` and `GET /`, SageMaker's and TEI's names for it).

- `/tokenize`: each input's tokens as the model will see them (ids, the token text, whether it is a
  special token, and the character offsets in the input), with the same truncation rule as embedding:
  an input past the model's maximum is refused unless the request (or the server) truncates.
- `/info`: what is served and how: model, version, dimensions, maximum length, pooling, graph, device,
  limits, and the server's version.
- `/decode`: token ids back to text, as the model's tokenizer decodes them (special tokens skipped unless
  asked for).
- `/health`: 200 only while the server serves (for the image's health check and Kubernetes probes); `/ping`
  answers the same, for SageMaker, whose containers are asked there, and so does a GET of `/`, as TEI's does
  (where cloud load balancers probe unless told otherwise).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from mhaserve.runtime.errors import NotFound, Unavailable
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.http.bodies import FAIL_FAST, count_first, documented, json_response, parse_json, validate
from mhaserve.service.http.openapi import request_body
from mhaserve.service.pipeline import Pipeline
from mhaserve.service.tei_info import tei_info
from mhaserve.service.tokens import Token
from mhaserve.service.tokens import tokenize as tokenize_texts
from mhaserve.service.version import SERVER_NAME, server_version

# /health; /ping, where SageMaker asks a container; and a GET of /, where TEI answers health and cloud load
# balancers probe by default (TEI answers the last two too)
HEALTH_PATHS = ("/health", "/ping", "/")


class TokenizeRequest(BaseModel):
    """The body of `POST /tokenize`."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [{"inputs": "hello world"}]})

    inputs: StrictStr | Annotated[list[StrictStr], documented(minItems=1), FAIL_FAST] = Field(
        description="a text or a list of texts"
    )
    model: StrictStr = Field(default="", description="a served model's name (default: the first served)")
    truncate: StrictBool = Field(
        default=False, description="cut inputs past the model's maximum instead of refusing them"
    )
    prompt_name: StrictStr | None = Field(default=None, description="a prompt of the model's serving config")
    add_special_tokens: StrictBool = Field(
        default=True,
        description="false: the answer leaves the special tokens ([CLS], [SEP]) out (the model still gets them, "
        "and the length limit counts them)",
    )


class DecodeRequest(BaseModel):
    """The body of `POST /decode`."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [{"ids": [101, 7592, 2088, 102]}]})

    ids: (
        Annotated[list[StrictInt], FAIL_FAST]
        | Annotated[list[Annotated[list[StrictInt], FAIL_FAST]], documented(minItems=1), FAIL_FAST]
    ) = Field(description="a list of token ids, or a list of lists of them")
    skip_special_tokens: StrictBool = Field(default=True, description="leave the special tokens ([CLS], [SEP]) out")
    model: StrictStr = Field(default="", description="a served model's name (default: the first served)")


class Health(BaseModel):
    status: Literal["SERVING", "NOT_SERVING"]
    reason: str | None = Field(default=None, description="why not serving: loading, stalled, or draining")


def describe(pipeline: Pipeline, max_message_bytes: int) -> dict[str, Any]:
    """One served model version, as /info shows it."""
    model, limits = pipeline.model, pipeline.limits
    m = model.entry.manifest
    entry = model.entry
    return {
        "model": model.name,
        "version": model.version,
        "source": m.source,
        "dimensions": m.hidden_size,
        "max_input_length": entry.max_tokens,
        "pooling": entry.pooling,
        "normalize": entry.normalize,
        "prompts": entry.prompts,
        "default_prompt_name": entry.default_prompt_name,
        "version_policy": pipeline.version_policy.describe(),
        "vocab_size": m.vocab_size,
        "graph": model.entry.graph,
        "sha256": model.entry.sha256,
        "device": model.provider,
        "limits": {
            "max_client_batch_size": limits.max_client_batch_size,
            "max_batch_tokens": limits.max_batch_tokens,
            "max_queue_size": limits.max_queue_size,
            "max_wait_ms": limits.max_wait_ms,
            "max_padding": limits.max_padding,
            "max_message_bytes": max_message_bytes,
            "auto_truncate": pipeline.auto_truncate,
        },
    }


def router(dataplane: DataPlane, *, max_message_bytes: int) -> APIRouter:
    api = APIRouter(tags=["Utility"])

    @api.post(
        "/tokenize",
        summary="Tokenise texts as the model will (ids, token texts, offsets)",
        response_model=list[list[Token]],
        openapi_extra=request_body(TokenizeRequest),
    )
    async def tokenize(request: Request) -> Response:
        req = validate(TokenizeRequest, parse_json(await request.body(), request.headers.get("content-type")))
        tokens = await tokenize_texts(
            dataplane.resolve(req.model),
            [req.inputs] if isinstance(req.inputs, str) else req.inputs,
            truncate=req.truncate,
            prompt_name=req.prompt_name,
            add_special_tokens=req.add_special_tokens,
            render=orjson.dumps,  # (the JSON made off the event loop too, when long)
        )
        return json_response(tokens)

    @api.post(
        "/decode",
        summary="Token ids back to text, as the model's tokenizer decodes them",
        response_model=list[str],
        openapi_extra=request_body(DecodeRequest),
    )
    async def decode(request: Request) -> Response:
        data = parse_json(await request.body(), request.headers.get("content-type"))
        count_first(dataplane, data, "ids")  # many lists refused before each is validated, as on the embedding routes
        req = validate(DecodeRequest, data)
        ids = req.ids
        # one list, or a list of them (an empty list is one, decoded to "", as TEI reads it)
        batch = cast(list[list[int]], ids if ids and isinstance(ids[0], list) else [ids])
        pipeline = dataplane.resolve(req.model)
        return json_response(await pipeline.decode(batch, skip_special_tokens=req.skip_special_tokens))

    @api.get("/info", summary="What is served: models, versions, dimensions, limits, device")
    async def info() -> Response:
        try:  # the default model's figures at the top, where it is served (TEI's fields too); every model's always
            pipeline = dataplane.resolve()
            default = {**tei_info(pipeline), **describe(pipeline, max_message_bytes)}
        except (NotFound, Unavailable):  # none served, or it is loading again (and so not served)
            default = {}
        return json_response(
            {
                **default,
                "server": {"name": SERVER_NAME, "version": server_version()},
                "models": [describe(p, max_message_bytes) for p in dataplane.pipelines()],
            }
        )

    async def health() -> Response:
        reason = dataplane.not_ready()
        if reason is None:
            return json_response({"status": "SERVING"})
        return json_response({"status": "NOT_SERVING", "reason": reason}, status=503)

    names = (("health", ""), ("ping", " (SageMaker's health check)"), ("health_root", " (TEI's, and probes')"))
    for path, (name, whose) in zip(HEALTH_PATHS, names, strict=True):
        api.add_api_route(
            path,
            health,
            methods=["GET"],
            summary="200 while the server serves; 503 while it loads, stalls or drains" + whose,
            response_model=Health,
            responses={503: {"model": Health, "description": "not serving: loading, stalled, or draining"}},
            name=name,
        )

    return api
