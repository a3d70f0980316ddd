"""The empty server of the paired one-client rounds (loadtest/bench/empty.py): it answers the clients users
have, over both protocols, as the server would answer one text, and a failure to start says why."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import openai
import pytest

from mhaserve.loadtest.bench.client import BenchError
from mhaserve.loadtest.bench.empty import EmptyServer
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc


@pytest.mark.parametrize("front", ["lean", "grpc"])
def test_the_empty_server_answers_the_real_clients_after_its_delay_and_stops_on_sigterm(
    tmp_path: Path, front: str
) -> None:
    server = EmptyServer(48, 0.05, tmp_path / "empty.log", front)
    with server.running():
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            stub.Encode(pb.EncodeRequest(texts=["warm"]), timeout=10)
            t0 = time.perf_counter()
            answer = stub.Encode(pb.EncodeRequest(texts=["a lone text"]), timeout=10)
            assert time.perf_counter() - t0 >= 0.05  # each call idles `delay` before its answer
        assert len(answer.embeddings) == 1 and len(answer.embeddings[0].values) == 48
        assert sum(v * v for v in answer.embeddings[0].values) == pytest.approx(1.0, rel=1e-5)
        # The official client asks for base64 and reads the float list it gets as well.
        t0 = time.perf_counter()
        got = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="-", max_retries=0).embeddings.create(
            model="any", input="a lone text"
        )
        assert time.perf_counter() - t0 >= 0.05
        assert len(got.data) == 1 and len(got.data[0].embedding) == 48
        assert len(server.pids()) == 1
        with pytest.raises(OSError):
            server.scrape()  # no metrics: the bench's points read None batches
    assert server.proc is not None and server.proc.returncode == 0  # SIGTERM: a clean exit


def test_the_empty_server_serves_grpc_on_the_front_it_is_given(tmp_path: Path) -> None:
    """Its floor is the served front's: grpc core's threads run in it only on grpc.aio's front."""
    for front in ("lean", "grpc"):
        server = EmptyServer(8, 0.0, tmp_path / f"{front}.log", front)
        with server.running(), grpc.insecure_channel(server.address) as channel:
            pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=["a"]), timeout=10)
            threads = {p.read_text().strip() for p in Path(f"/proc/{server.pids()[0]}/task").glob("*/comm")}
        assert ("grpc_global_tim" in threads) == (front == "grpc"), (front, threads)
    with pytest.raises(ValueError, match="no gRPC front 'aio'"):
        EmptyServer(8, 0.0, tmp_path / "x.log", "aio")


def test_an_empty_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    server = EmptyServer(0, 0.0, tmp_path / "empty.log")  # no dimensions: the answer cannot be built
    with pytest.raises(BenchError, match="the empty server did not start"):
        server.start(timeout=30)
