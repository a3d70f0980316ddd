"""deploy/clients/grpc-service-config.json, the retry policy docs/deploy.md gives gRPC clients of replicas behind
a balancer, read by grpcio itself: a server on a loopback port answers every call UNAVAILABLE (what a draining
replica's calls may get) and counts the attempts each method's call made.

Every unary method of every service the server serves is retried (encoding has no side effects), but for the
repository's load and unload, which may take minutes and are not to be sent twice; a stream is never replayed
(its requests may have been answered already).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2
from mhaserve.proto.inference.v2 import grpc_service_pb2
from mhaserve.proto.tei.v1 import tei_pb2
from mhaserve.service.tei_v1 import SERVED_SERVICES as TEI_SERVED
from tests.deploy.helpers import DEPLOY

CONFIG = DEPLOY / "clients" / "grpc-service-config.json"
MAX_ATTEMPTS = 4  # the policy's maxAttempts
NOT_RETRIED = {f"/inference.GRPCInferenceService/RepositoryModel{change}" for change in ("Load", "Unload")}


def served_methods() -> Iterator[tuple[str, bool]]:
    """(path, is a stream) for each method of each service the server serves on its gRPC port."""
    services = [encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"]]
    services.append(grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"])
    services += [s for s in tei_pb2.DESCRIPTOR.services_by_name.values() if s.full_name in TEI_SERVED]
    for service in services:
        for method in service.methods:
            yield f"/{service.full_name}/{method.name}", method.client_streaming or method.server_streaming


class Unavailable(grpc.GenericRpcHandler):
    """Every call answered UNAVAILABLE, its attempts counted by method."""

    def __init__(self) -> None:
        self.attempts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method: str = details.method

        def refuse(_: Any, context: grpc.ServicerContext) -> None:
            with self.lock:
                self.attempts[method] += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "draining")

        return grpc.stream_stream_rpc_method_handler(refuse)


@pytest.fixture
def refusing() -> Iterator[tuple[str, Unavailable]]:
    handler = Unavailable()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", handler
    finally:
        server.stop(0)


@pytest.mark.parametrize(("method", "stream"), list(served_methods()), ids=lambda v: v if isinstance(v, str) else "")
def test_each_served_method_is_retried_unless_a_stream_or_a_repository_change(
    refusing: tuple[str, Unavailable], method: str, stream: bool
) -> None:
    address, handler = refusing
    options = [("grpc.enable_retries", 1), ("grpc.service_config", CONFIG.read_text())]
    with grpc.insecure_channel(address, options=options) as channel:
        # Bytes in, bytes out: the methods' own messages play no part in a retry.
        call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as refused:
            list(call(iter([b""]), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    expected = 1 if stream or method in NOT_RETRIED else MAX_ATTEMPTS
    assert handler.attempts[method] == expected, f"{method}: {handler.attempts[method]} attempts, expected {expected}"
