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
