"""The metrics registry alone: a version's series, and what its unloading leaves; the metrics port's few
connections."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from mhaserve.service import metrics as m
from mhaserve.service.metrics import METRICS_CONNECTIONS, METRICS_SLOW_ANSWER_S, Metrics, ModelMetrics
from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.metrics import scrape


def test_an_unloaded_version_takes_every_series_of_its_own_with_it() -> None:
    metrics = Metrics()
    version = ModelMetrics(metrics, "m", 1)
    version.served("CPUExecutionProvider")
    for code in ("OK", "OK", "INVALID_ARGUMENT"):
        version.ended(code)
    version.stalls.inc()
    text = generate_latest(metrics.registry).decode()
    assert 'mhaserve_model_requests_total{code="OK",model="m",version="1"} 2.0' in text
    assert 'mhaserve_model_requests_total{code="INVALID_ARGUMENT",model="m",version="1"} 1.0' in text
    version.unloaded()
    left = [line for line in generate_latest(metrics.registry).decode().splitlines() if 'model="m"' in line]
    assert left == ['mhaserve_model_ready{model="m",version="1"} 0.0']  # ready says 0; the rest are gone


def test_a_versions_series_go_with_its_last_copy() -> None:
    """Two copies of a version at once (one loading while the other finishes its queue) are given the same
    series: the first to close took them from the other, which went on counting into series no longer
    exported. The provider of a copy that closed goes unless another copy runs on it."""
    metrics = Metrics()
    old, new = ModelMetrics(metrics, "m", 1), ModelMetrics(metrics, "m", 1)
    old.served("CUDAExecutionProvider")
    old.ended("CANCELLED")
    new.served("CPUExecutionProvider")
    new.ended("OK")
    old.discard()
    new.inputs.inc()

    def own() -> list[str]:
        return [line for line in generate_latest(metrics.registry).decode().splitlines() if 'model="m"' in line]

    assert 'mhaserve_inputs_total{model="m",version="1"} 1.0' in own()
    assert 'mhaserve_model_requests_total{code="CANCELLED",model="m",version="1"} 1.0' in own()
    providers = [line for line in own() if line.startswith("mhaserve_execution_provider_info")]
    assert providers == ['mhaserve_execution_provider_info{model="m",provider="CPUExecutionProvider",version="1"} 1.0']
    old.discard()  # said twice: still one copy's
    assert any(line.startswith("mhaserve_queue_depth") for line in own())
    new.unloaded()
    assert own() == ['mhaserve_model_ready{model="m",version="1"} 0.0']


# -- the metrics port's connections --


@pytest.fixture
def served() -> Iterator[tuple[Metrics, int]]:
    """Metrics served on a free loopback port."""
    metrics = Metrics()
    try:
        yield metrics, metrics.serve("127.0.0.1", 0)
    finally:
        metrics.close()


def connection_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed `s` well before its read timeout would have."""
    s.settimeout(m.METRICS_READ_TIMEOUT_S / 2)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_flood_of_silent_connections_holds_a_few_threads_and_a_scrape_gets_in(
    served: tuple[Metrics, int], caplog: pytest.LogCaptureFixture
) -> None:
    """The bug: connections to the metrics port were outside --max-connections, a thread and a descriptor each
    for 10 s; 440 silent ones took every descriptor of a process allowed 320, and its client ports failed to
    accept. Now past METRICS_CONNECTIONS a newcomer closes the oldest still silent one."""
    _, port = served
    caplog.set_level(logging.WARNING, logger=m.__name__)
    before = connection_threads()  # other tests' servers in this process may still hold some
    flood = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(3 * METRICS_CONNECTIONS)]
    try:
        # the oldest were closed to make room (on the code before, each waited out its 10 s), the newest held
        assert all(closed_by_server(s) for s in flood[: 2 * METRICS_CONNECTIONS])
        wait_until(
            lambda: connection_threads() - before <= METRICS_CONNECTIONS, "the closed connections' threads to end"
        )
        last = flood[-1]
        last.settimeout(0.2)
        with pytest.raises(TimeoutError):
            last.recv(1)  # still open, waiting for its request
        assert scrape(port).get("mhaserve_requests_in_flight") == 0  # a scraper gets in past the flood
    finally:
        for s in flood:
            s.close()
    lines = [r.getMessage() for r in caplog.records if r.name == m.__name__]
    assert len(lines) == 1, lines  # one a minute
    assert "holds its limit of 16 connections" in lines[0] and "closed an older one" in lines[0]


def test_with_every_place_answering_a_newcomer_is_turned_away_but_a_slow_reader_gives_way(
    served: tuple[Metrics, int],
) -> None:
    """A place answering a request is not taken from it for a newcomer unless its answer has been going out for
    longer than METRICS_SLOW_ANSWER_S (a client that does not read it)."""
    metrics, port = served
    assert metrics._http is not None
    server = metrics._http[0]
    assert isinstance(server, m._Server)
    pairs = [socket.socketpair() for _ in range(METRICS_CONNECTIONS)]
    try:
        now = time.monotonic()
        with server._lock:
            for ours, _ in pairs:
                server._held[ours] = now  # every place answering, since now
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
            assert closed_by_server(s)  # turned away unanswered
        with server._lock:
            server._held[pairs[3][0]] = now - 2 * METRICS_SLOW_ANSWER_S
        assert scrape(port).get("mhaserve_requests_in_flight") == 0  # the slow one gave way
        assert closed_by_server(pairs[3][1])
        pairs[0][1].settimeout(0.2)
        with pytest.raises(TimeoutError):
            pairs[0][1].recv(1)  # the others untouched
    finally:
        with server._lock:
            for ours, _ in pairs:
                server._held.pop(ours, None)
        for pair in pairs:
            for s in pair:
                s.close()
