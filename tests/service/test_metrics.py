"""The metrics registry alone: a version's series, and what its unloading leaves."""

from __future__ import annotations

from prometheus_client import generate_latest

from mhaserve.service.metrics import Metrics, ModelMetrics


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
