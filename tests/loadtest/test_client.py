"""The bench's server subprocess (loadtest/bench/client.py): it starts again on new ports when one it was given is
taken before it binds it, and any other failure to start says why, with the server's own last lines."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mhaserve.loadtest.bench import client
from mhaserve.loadtest.bench.client import BenchError
from mhaserve.testing.loopback import free_ports
from mhaserve.testing.metrics import scrape
from mhaserve.testing.process import memory
from mhaserve.testing.server import health_status
from tests.loadtest.conftest import bench_server


@pytest.fixture
def taken() -> Iterator[socket.socket]:
    """A port something else listens on (without SO_REUSEPORT, so nobody can share it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def test_free_ports_are_distinct() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64


@pytest.mark.parametrize("which", [0, 1, 2], ids=["grpc", "metrics", "http"])
def test_a_port_taken_before_the_server_binds_it_is_replaced(
    which: int, taken: socket.socket, tiny_entry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = taken.getsockname()[1]
    choices: list[list[int]] = []

    def first_one_taken(n: int) -> list[int]:
        ports = free_ports(n)
        if not choices:  # the race, made certain: the first choice includes a port in use
            ports[which] = port
        choices.append(ports)
        return ports

    monkeypatch.setattr(client, "free_ports", first_one_taken)
    server = bench_server(tiny_entry, tmp_path / "server.log")
    with server.running() as info:
        assert info.name == "tiny"
        assert len(choices) == 2 and port not in choices[1]
        assert [server.port, server.metrics_port, server.http_port] == choices[1]
        with grpc.insecure_channel(server.address) as channel:
            assert health_status(channel) == "SERVING"
    log = server.log_path.read_text()
    assert "Address already in use" in log  # the first attempt's own words are kept
    assert log.count("[bench] a port was in use") == 1


def test_a_port_taken_every_time_gives_up(
    taken: socket.socket, tiny_entry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = taken.getsockname()[1]
    monkeypatch.setattr(client, "free_ports", lambda n: [port, *free_ports(n - 1)])
    server = bench_server(tiny_entry, tmp_path / "server.log")
    with pytest.raises(BenchError, match="a port was taken 3 times in a row") as failure:
        server.start(attempts=3)
    server.stop()
    assert "Address already in use" in str(failure.value)
    assert server.log_path.read_text().count("[bench] a port was in use") == 2


def test_any_other_failure_to_start_is_an_error_with_the_servers_last_lines(tiny_entry: Path, tmp_path: Path) -> None:
    server = bench_server(tiny_entry, tmp_path / "server.log", models=["no-such-model"])
    with pytest.raises(BenchError, match="the server exited with status 1") as failure, server.running():
        pass
    assert "no-such-model" in str(failure.value)  # the server's reason, not only where its log is
    assert "[bench]" not in server.log_path.read_text()  # not retried


@pytest.mark.slow
def test_a_server_of_two_processes_is_measured_as_a_whole(tiny_entry: Path, tmp_path: Path) -> None:
    """With --processes 2 the bench counts both processes' CPU, memory and metrics, and gives each gRPC
    client a connection of its own so that both get calls."""
    from mhaserve.loadtest.bench.workloads import Workload

    server = bench_server(tiny_entry, tmp_path / "server.log", extra=["--processes=2"])
    with server.running():
        assert server.processes == 2 and server.own_channels
        assert len(server.pids()) == 3  # the supervisor and its two server processes
        texts = [f"text number {i}" for i in range(16)]
        workload = Workload("t", "texts", "texts", [[1]] * 16, texts)
        point = client.run_point(server, workload, 16, duration=1.0, warmup_max=10.0)
        assert point["errors"] == {} and point["completed"] > 0
        # The supervisor runs no model: an inference thread's CPU is the server processes'.
        assert point["server_threads_ms_per_request"]["inference"] > 0
        own_ports = [server.metrics_port + 1 + i for i in range(2)]
        per_process = [scrape(port).get("mhaserve_requests_total", code="OK") for port in own_ports]
        # 16 connections hashed over two listeners: both got calls (all on one: p = 2^-15).
        assert min(per_process) > 0, per_process
        # The supervisor's port has them all, labelled by process.
        gathered = server.scrape()
        assert gathered.get("mhaserve_requests_total", code="OK") == sum(per_process)
        assert [gathered.get("mhaserve_requests_total", code="OK", process=f"p{i}") for i in range(2)] == per_process
        whole, first = server.memory(), memory(server.pids()[1])
        assert whole.rss_kib > first.rss_kib


def test_one_client_on_a_synchronous_stub_is_measured_and_its_refusals_counted(
    tiny_entry: Path, tmp_path: Path
) -> None:
    from mhaserve.loadtest.bench.transports import CallFailed, GrpcSyncClient
    from mhaserve.loadtest.bench.workloads import Workload

    texts = [f"text number {i}" for i in range(8)]
    workload = Workload("t", "texts", "texts", [[1]] * 8, texts)
    server = bench_server(tiny_entry, tmp_path / "server.log")
    with server.running():
        point = client.run_point(server, workload, 1, duration=0.5, warmup_max=10.0, protocol="grpc-sync")
        assert point["protocol"] == "grpc-sync" and point["concurrency"] == 1 and point["errors"] == {}
        assert point["completed"] > 0 and 0 < point["latency_ms"]["p50"] <= point["latency_ms"]["p99"]
        assert 0.5 <= point["seconds"] < 1.0 and point["server_threads_ms_per_request"]["inference"] > 0
        # Served requests were counted by the server too: the window's calls are among them.
        assert server.scrape().get("mhaserve_requests_total", code="OK") > point["completed"]
        with (
            GrpcSyncClient(server.address, workload, model="no-such-model") as refused,
            pytest.raises(CallFailed) as failure,
        ):
            refused.send(0)
        assert failure.value.key == "NOT_FOUND"
        with pytest.raises(ValueError, match="one client"):
            client.run_point(server, workload, 2, duration=0.5, warmup_max=10.0, protocol="grpc-sync")
