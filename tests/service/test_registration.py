"""Services on the gRPC server as generic handlers only (service/rpc/registration.py), on a bare grpc.aio server."""

from __future__ import annotations

import asyncio
import asyncio.tasks
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import grpc.aio
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.rpc.registration import GenericOnly
from mhaserve.testing.loopback import WAIT


class Echo(pb_grpc.EncoderServiceServicer):
    async def Encode(self, request: pb.EncodeRequest, context: Any) -> pb.EncodeResponse:
        return pb.EncodeResponse(model=request.texts[0])


class Bare:
    """encoder.v1 on a grpc.aio server of its own loop and thread, added through `wrap(server)`."""

    def __init__(self, wrap: Callable[[grpc.aio.Server], Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(wrap), self.loop).result(WAIT)

    async def _start(self, wrap: Callable[[grpc.aio.Server], Any]) -> int:
        self.server = grpc.aio.server()
        pb_grpc.add_EncoderServiceServicer_to_server(Echo(), wrap(self.server))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return int(port)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(WAIT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)
        self.loop.close()


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of futures in each asyncio.wait made while the test runs (grpc.aio's accept loop makes one
    after every call)."""
    sizes: list[int] = []
    real = asyncio.tasks._wait  # type: ignore[attr-defined]  # private, and what grpc.aio reaches through asyncio.wait

    async def counted(fs: Any, *args: Any) -> Any:
        sizes.append(len(fs))
        return await real(fs, *args)

    monkeypatch.setattr(asyncio.tasks, "_wait", counted)
    return sizes


def calls(port: int, n: int) -> Iterator[tuple[grpc.StatusCode, str]]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.EncoderServiceStub(channel)
        for i in range(n):
            yield grpc.StatusCode.OK, stub.Encode(pb.EncodeRequest(texts=[f"t{i}"]), timeout=WAIT).model
        try:
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=WAIT)
        except grpc.RpcError as e:
            yield e.code(), e.details() or ""


def test_every_method_is_served_by_the_generic_handler(waits: list[int]) -> None:
    bare = Bare(GenericOnly)
    try:
        got = list(calls(bare.port, 5))
    finally:
        bare.stop()
    assert got[:5] == [(grpc.StatusCode.OK, f"t{i}") for i in range(5)]
    assert got[5][0] == grpc.StatusCode.UNIMPLEMENTED  # routed to Echo, which leaves it to the base class
    # grpc.aio's accept loop waits on one pending accept, whatever the number of methods.
    assert waits and set(waits) == {1}


def test_registered_methods_cost_a_wait_on_all_of_them_at_every_call(waits: list[int]) -> None:
    """What GenericOnly avoids, on this grpcio: with the stubs' registrations, the accept loop waits on one
    future per method plus one after every call. If this fails, grpc changed how it accepts calls and
    registration.py's reason should be measured again."""
    bare = Bare(lambda server: server)
    try:
        got = list(calls(bare.port, 5))
    finally:
        bare.stop()
    assert got[:5] == [(grpc.StatusCode.OK, f"t{i}") for i in range(5)]
    methods = len(pb.DESCRIPTOR.services_by_name["EncoderService"].methods)
    assert waits.count(methods + 1) >= 5
