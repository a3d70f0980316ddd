"""gRPC server reflection, as `grpc.reflection.v1` and `grpc.reflection.v1alpha`, so grpcurl and other
clients need no .proto files.

grpcio-reflection serves only v1alpha; newer grpcurl and clients try v1 first. The two protocols are
the same messages under another package name (same fields, same numbers), so v1 is the same servicer
registered at v1's method path: its requests decode as v1alpha's and its answers encode as v1's.

The servicer answers from `_Pool`: protobuf's default pool (every served service's file is there, its
stubs imported), with v1 reflection's own file, which grpcio-reflection does not ship (listed but not
found, it stopped `grpcurl describe` at it), and a method's name leading to its service's file (`grpcurl
describe pkg.Service.Method`), which protobuf's pool does not find.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha import reflection_pb2_grpc as rpb_grpc

from mhaserve.service.rpc.registration import GenericOnly

V1ALPHA = reflection.SERVICE_NAME
V1 = "grpc.reflection.v1.ServerReflection"
SERVICES = (V1, V1ALPHA)


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's file under v1's name and package (its language options,
    which name v1alpha's packages, left out)."""
    proto = descriptor_pb2.FileDescriptorProto()
    rpb.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    proto.ClearField("options")
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a scalar field has none, and must not be given an empty one
                field.type_name = field.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    return proto


class _Pool:
    """The descriptors reflection answers from; see the module docstring. What the servicer asks of a pool
    other than files (extensions) goes to the default pool."""

    def __init__(self) -> None:
        self.default = descriptor_pool.Default()
        self.v1 = descriptor_pool.DescriptorPool()
        self.v1.Add(_v1_file())

    def FindFileByName(self, name: str) -> FileDescriptor:  # noqa: N802 (DescriptorPool's name)
        return self._first(lambda pool: pool.FindFileByName(name), name)

    def FindFileContainingSymbol(self, symbol: str) -> FileDescriptor:  # noqa: N802 (DescriptorPool's name)
        def find(pool: descriptor_pool.DescriptorPool) -> FileDescriptor:
            try:
                return pool.FindFileContainingSymbol(symbol)
            except KeyError:
                service, _, method = symbol.rpartition(".")
                found = pool.FindServiceByName(service)  # KeyError: not a method's name either
                if method not in found.methods_by_name:
                    raise KeyError(symbol) from None
                return found.file

        return self._first(find, symbol)

    def _first(self, find: Any, name: str) -> FileDescriptor:
        for pool in (self.default, self.v1):
            try:
                return find(pool)
            except KeyError:
                pass
        raise KeyError(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.default, name)


def add_reflection(server: GenericOnly, services: Sequence[str]) -> None:
    """Serve reflection for `services` (and for reflection itself) under both versions."""
    servicer = reflection.aio.ReflectionServicer((*services, *SERVICES), pool=_Pool())
    rpb_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=rpb.ServerReflectionRequest.FromString,
        response_serializer=rpb.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1, {"ServerReflectionInfo": v1}),))
