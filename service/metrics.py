"""Prometheus metrics, one private registry per server so that several servers can share a process."""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

# 0.5 ms to 30 s: a tiny model's batch on a GPU up to a long queue on a busy CPU.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = tuple(float(2**i) for i in range(13))  # 1 .. 4096 inputs
TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 18))  # 16 .. 131072 tokens
FRACTION_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class Metrics:
    """Every metric the server exports; names are part of the contract with dashboards and `mhaserve bench`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mhaserve_requests", "RPCs answered, by method and gRPC status code", ["method", "code"], registry=r
        )
        self.request_duration = Histogram(
            "mhaserve_request_duration_seconds",
            "Time from receiving an RPC to answering it",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("mhaserve_requests_in_flight", "RPCs being handled now", registry=r)
        self.tokenize = Histogram(
            "mhaserve_tokenize_duration_seconds", "Tokenisation time per request", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "mhaserve_queue_wait_seconds",
            "Time a request waits in the queue before its first input reaches the model",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "mhaserve_inference_duration_seconds", "Model time per batch", buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram("mhaserve_batch_size", "Inputs per batch", buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "mhaserve_batch_tokens", "Tokens per batch, padding included", buckets=TOKEN_BUCKETS, registry=r
        )
        self.padding_fraction = Histogram(
            "mhaserve_padding_fraction",
            "Share of each batch's tokens that are padding",
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("mhaserve_queue_depth", "Inputs waiting for the model", registry=r)
        self.provider = Gauge(
            "mhaserve_execution_provider_info",
            "The ONNX Runtime execution provider the model session got (value 1)",
            ["provider"],
            registry=r,
        )
        self.inputs = Counter("mhaserve_inputs", "Inputs embedded", registry=r)
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the bound port (useful when `port` is 0)."""
        self._http = start_http_server(port, addr=host, registry=self.registry)
        bound = int(self._http[0].server_port)
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None
