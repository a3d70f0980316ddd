"""The bench's own HTTP/2 gRPC client (`--grpc-client h2`) against real servers on both gRPC fronts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import hpack
import pytest

from mhaserve.loadtest.bench.h2client import request_blocks
from mhaserve.loadtest.bench.transports import CallFailed, transport
from mhaserve.loadtest.bench.workloads import Workload
from mhaserve.service.rpc.lean import frames as f
from mhaserve.testing.server import ServerThread, local_settings

TEXTS = [f"text number {i}, " + "word " * (i % 7) for i in range(64)]


def _workload() -> Workload:
    return Workload("short", "test", "texts", [[101, 102]] * len(TEXTS), TEXTS)


async def _tokens(address: str, grpc_client: str, model: str = "", own_channels: bool = False) -> list[int]:
    link = transport("grpc", address, "", _workload(), model, own_channels=own_channels, grpc_client=grpc_client)
    async with link:
        sends = [link.client() for _ in range(8)]
        return list(await asyncio.gather(*(sends[i % 8](i) for i in range(len(TEXTS)))))


@pytest.fixture(scope="module")
def server(tiny_repo: Path, grpc_front: str) -> Iterator[ServerThread]:
    with ServerThread(local_settings(tiny_repo, grpc_front=grpc_front)).ready() as srv:
        yield srv


def test_each_call_gets_the_answer_grpc_aio_gets(server: ServerThread) -> None:
    expected = asyncio.run(_tokens(server.address, "aio"))
    assert asyncio.run(_tokens(server.address, "h2")) == expected
    assert asyncio.run(_tokens(server.address, "h2", own_channels=True)) == expected
    assert len(set(expected)) > 1  # the texts differ in length: each answer is its own call's


def test_a_connections_later_calls_name_their_headers_by_index_as_grpc_core_does() -> None:
    # Literals every call would cost the server a decode that no grpc client asks of it.
    blocks = request_blocks("127.0.0.1:50051", 30.0)
    server_side = hpack.Decoder()
    first = cast(list[tuple[str, str]], server_side.decode(blocks.first))  # str: the decoder's default
    assert dict(first) | {":path": ""} == {
        ":method": "POST", ":scheme": "http", ":path": "", ":authority": "127.0.0.1:50051",
        "content-type": "application/grpc", "te": "trailers", "grpc-timeout": "30S",
    }  # fmt: skip
    assert dict(first)[":path"] == "/encoder.v1.EncoderService/Encode"
    assert len(server_side.header_table.dynamic_entries) == 5  # all but the static table's POST and http
    # After it, one byte a field, read straight from the table (the server's fast path), the table unchanged.
    assert len(blocks.repeat) == len(first)
    assert f.indexed_fields(blocks.repeat, server_side.header_table, 16384) == first
    assert server_side.decode(blocks.repeat) == first
    assert len(server_side.header_table.dynamic_entries) == 5


def test_a_refused_call_is_counted_by_its_status(server: ServerThread) -> None:
    with pytest.raises(CallFailed) as e:
        asyncio.run(_tokens(server.address, "h2", model="no-such-model"))
    assert e.value.key == "NOT_FOUND"


def test_a_server_that_is_not_there_fails_at_once() -> None:
    from mhaserve.testing.loopback import free_port

    with pytest.raises(OSError):
        asyncio.run(_tokens(f"127.0.0.1:{free_port()}", "h2"))


def test_the_report_names_the_grpc_client_it_measured_with() -> None:
    from mhaserve.loadtest.bench.report import client_names

    assert client_names({"settings": {"grpc_client": "h2"}})["grpc"] == "gRPC (the bench's HTTP/2 client)"
    assert client_names({"settings": {"grpc_client": "aio"}})["grpc"] == "gRPC (grpc.aio's client)"


def test_the_one_client_section_says_which_grpc_client_it_measured_with() -> None:
    from mhaserve.loadtest.bench.report import _one_client_section

    point = {"p50_ms": 3.0, "gap_ms": 1.0, "p99_ms": 4.0, "client_cpu_ms_per_request": 0.2}
    lone = {"reference_p50_ms": 2.0, "batching": "length", "clients": {"grpc": point, "http": point}}
    for client, name in (("h2", "gRPC (the bench's HTTP/2 client)"), ("aio", "gRPC (grpc.aio's client)")):
        text = "\n".join(
            _one_client_section({"settings": {"grpc_client": client}, "summary": {"short": {"one_client": lone}}})
        )
        assert f"{name} is the load generator's client" in text
        assert f"| short | length | {name} | 3.00 |" in text
