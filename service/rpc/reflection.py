"""gRPC server reflection, as `grpc.reflection.v1` and `grpc.reflection.v1alpha`, so grpcurl and other
clients need no .proto files.

grpcio-reflection serves only v1alpha; newer grpcurl and clients try v1 first. The two protocols are
the same messages under another package name (same fields, same numbers), so v1 is the same servicer
registered at v1's method path: its requests decode as v1alpha's and its answers encode as v1's.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import grpc.aio
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha import reflection_pb2_grpc as rpb_grpc

from mhaserve.service.rpc.registration import GenericOnly

V1ALPHA = reflection.SERVICE_NAME
V1 = "grpc.reflection.v1.ServerReflection"
SERVICES = (V1, V1ALPHA)


def add_reflection(server: GenericOnly, services: Sequence[str]) -> None:
    """Serve reflection for `services` (and for reflection itself) under both versions."""
    servicer = reflection.aio.ReflectionServicer((*services, *SERVICES))
    rpb_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=rpb.ServerReflectionRequest.FromString,
        response_serializer=rpb.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": v1}),))
