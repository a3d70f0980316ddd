"""Bad input: hypothesis over every request field of both APIs; never INTERNAL, UNKNOWN or UNAVAILABLE."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mhaserve.loadtest.reliability.scenarios.common import OK, code_of
from mhaserve.loadtest.reliability.strategies import (
    Model,
    encode_requests,
    infer_requests,
    kserve_names,
    names,
    request_ids,
)
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2 as kpb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as kpb_grpc
from mhaserve.service.client import CHANNEL_OPTIONS
from mhaserve.service.kserve.tensors import pack_bytes
from mhaserve.testing.loopback import WAIT

CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
# What bad input may get: never INTERNAL or UNKNOWN (a bug), never UNAVAILABLE (the server gave up).
CLIENT_CODES = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED"})


@dataclass
class FuzzResult:
    """Cases tried per API, the status codes they got (stream errors included), and what went wrong."""

    cases: Counter[str] = field(default_factory=Counter)
    codes: dict[str, Counter[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    checks_after: int = 0  # health + good request checks, one after every case
    seconds: float = 0.0


GOOD_TEXTS = ["a good request right after", "and a second input"]


def fuzz(address: str, model: Model, *, examples: int, seed: int | None = 0) -> FuzzResult:
    """Hypothesis over every request field of encoder.v1 and the Open Inference Protocol, `examples` cases
    per API, against a running server. After every case: health must say SERVING and a good request must
    get the same embeddings as before the fuzzing."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as with_seed
    from hypothesis import strategies as st

    result = FuzzResult(codes={"encoder.v1": Counter(), "inference.v2": Counter()})
    t0 = time.perf_counter()
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    enc = pb_grpc.EncoderServiceStub(channel)
    inf = kpb_grpc.GRPCInferenceServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    good = pb.EncodeRequest(texts=GOOD_TEXTS)
    tensor = kpb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[len(GOOD_TEXTS)])
    good_v2 = kpb.ModelInferRequest(
        model_name=model.name, inputs=[tensor], raw_input_contents=[pack_bytes([t.encode() for t in GOOD_TEXTS])]
    )
    reference = np.array([e.values for e in enc.Encode(good, timeout=WAIT).embeddings], dtype=np.float32)

    def after(api: str) -> None:
        result.cases[api] += 1
        result.checks_after += 1
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT).status
        assert status == health_pb2.HealthCheckResponse.SERVING, f"health says {status} after that request"
        got = np.array([e.values for e in enc.Encode(good, timeout=WAIT).embeddings], dtype=np.float32)
        assert np.abs(got - reference).max() <= 1e-5, "a good request got another answer after that request"
        response = inf.ModelInfer(good_v2, timeout=WAIT)
        v2 = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(reference.shape)
        assert np.abs(v2 - reference).max() <= 1e-5

    def record(api: str, code: str, what: str) -> None:
        result.codes[api][code] += 1
        assert code in CLIENT_CODES, f"{what} got {code}"

    def metadata(rid: str) -> tuple[tuple[str, str], ...] | None:
        return (("x-request-id", rid),) if rid else None

    config = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )

    @config
    @given(data=st.data())
    def encoder_v1(data: st.DataObject) -> None:
        method = data.draw(st.sampled_from(["Encode", "Encode", "Encode", "EncodeStream", "GetModelInfo"]))
        md = metadata(data.draw(request_ids()))
        if method == "Encode":
            request = data.draw(encode_requests(model))
            code, _ = code_of(lambda: enc.Encode(request, metadata=md, timeout=60))
            record("encoder.v1", code, "Encode")
        elif method == "EncodeStream":
            requests = data.draw(st.lists(encode_requests(model), max_size=4))
            code, responses = code_of(lambda: list(enc.EncodeStream(iter(requests), metadata=md, timeout=60)))
            record("encoder.v1", code, "EncodeStream")
            for r in responses or ():
                record("encoder.v1", CODE_NAMES[r.error.code] if r.HasField("error") else OK, "a stream response")
            assert responses is None or len(responses) == len(requests), "a stream lost a response"
        else:
            name = data.draw(names(model))
            code, _ = code_of(lambda: enc.GetModelInfo(pb.GetModelInfoRequest(model=name), metadata=md, timeout=60))
            record("encoder.v1", code, "GetModelInfo")
        after("encoder.v1")

    @config
    @given(data=st.data())
    def inference_v2(data: st.DataObject) -> None:
        methods = ["ModelInfer"] * 4 + ["ModelStreamInfer", "ModelMetadata", "ModelConfig", "ModelStatistics"]
        method = data.draw(st.sampled_from([*methods, "ModelReady", "ServerMetadata", "ServerReady"]))
        md = metadata(data.draw(request_ids()))
        if method == "ModelInfer":
            request = data.draw(infer_requests(model))
            code, _ = code_of(lambda: inf.ModelInfer(request, metadata=md, timeout=60))
        elif method == "ModelStreamInfer":
            requests = data.draw(st.lists(infer_requests(model), max_size=4))
            code, responses = code_of(lambda: list(inf.ModelStreamInfer(iter(requests), metadata=md, timeout=60)))
            for r in responses or ():
                record("inference.v2", r.error_message.split(":")[0] if r.error_message else OK, "a stream response")
            assert responses is None or len(responses) == len(requests), "a stream lost a response"
        else:
            name, version = data.draw(kserve_names(model)), data.draw(st.one_of(st.just(""), st.text(max_size=8)))
            stub_method = getattr(inf, method)
            request_type = getattr(kpb, f"{method}Request")
            fields = request_type.DESCRIPTOR.fields_by_name
            kwargs = {k: v for k, v in (("name", name), ("version", version)) if k in fields}
            code, _ = code_of(lambda: stub_method(request_type(**kwargs), metadata=md, timeout=60))
        record("inference.v2", code, method)
        after("inference.v2")

    try:
        for test in (encoder_v1, inference_v2):
            if seed is not None:
                test = with_seed(seed)(test)
            try:
                test()
            except Exception as e:  # hypothesis has shrunk it: report the smallest case
                result.failures.append(f"{test.__name__}: {type(e).__name__}: {e}")
    finally:
        channel.close()
        result.seconds = time.perf_counter() - t0
    return result
