"""Prometheus metrics, one private registry per server so that several servers can share a process.

Request metrics are labelled by protocol method and status; what the pipeline and the batcher measure is
labelled by model and version (`ModelMetrics`), and a version's series go away when it is unloaded.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from mhaserve.service.context import Throttle

T = TypeVar("T")

log = logging.getLogger(__name__)

# 0.5 ms to 30 s: a tiny model's batch on a GPU up to a long queue on a busy CPU.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = tuple(float(2**i) for i in range(13))  # 1 .. 4096 inputs
TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 18))  # 16 .. 131072 tokens
FRACTION_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


# A connection to the metrics port that sends no request within this time is closed. prometheus_client's own
# server has no timeout and starts a thread per connection: 400 silent connections held 400 threads.
METRICS_READ_TIMEOUT_S = 10.0

# At most this many connections to the metrics port at once (a thread and a descriptor each). Its connections
# are not counted by --max-connections, and come out of the descriptors kept for the server's own files: 440
# silent ones took 316 threads and every descriptor of a process allowed 320, and the client ports failed to
# accept (EMFILE) until they timed out. A scraper or two, and a person with curl, need a few.
METRICS_CONNECTIONS = 16
# A connection past that closes the oldest one still sending its request (a scraper sends its request as soon
# as it connects), or else the oldest whose answer has been going out for longer than this (a client that does
# not read it); with neither, the newcomer is closed unanswered.
METRICS_SLOW_ANSWER_S = 1.0

CROWDED = "the metrics port holds its limit of"

# The readiness gauge, which the --processes supervisor also exports, at 0, for a process of its own that does not
# serve (service/processes.py): that process's metrics port is not read then.
READY = "mhaserve_ready"
READY_HELP = "1 while the server reports SERVING (health, readiness), 0 while it is not"


class _Handler(WSGIRequestHandler):
    timeout = METRICS_READ_TIMEOUT_S
    server: _Server

    def parse_request(self) -> bool:
        whole = super().parse_request()  # the request line and the headers read
        if whole:
            self.server.answering(self.request)
        return whole

    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's default is 5)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        # the connections held, oldest first: None while its request arrives, else when its answer began
        self._held: dict[socket.socket, float | None] = {}
        self._closing: set[socket.socket] = set()  # shut to make room, their threads ending
        self._lines = Throttle((), interval=60.0)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            if len(self._held) - len(self._closing) >= METRICS_CONNECTIONS and not self._make_room():
                request.close()
                return
            self._held[request] = None
        super().process_request(request, client_address)  # its thread

    def _make_room(self) -> bool:
        """Shut the oldest connection still sending its request, else the oldest slow to read its answer; its
        thread then reads the end (or fails its write) and ends. False if every place is answering a scrape."""
        now = time.monotonic()
        shut = next((s for s, began in self._held.items() if began is None and s not in self._closing), None)
        if shut is None:
            shut = next(
                (
                    s
                    for s, began in self._held.items()
                    if began is not None and now - began > METRICS_SLOW_ANSWER_S and s not in self._closing
                ),
                None,
            )
        left_out = self._lines.passes(CROWDED)
        if left_out is not None:
            log.warning(
                "%s %d connections (--metrics-host should keep it private): %s%s",
                CROWDED,
                METRICS_CONNECTIONS,
                "closed an older one for a new one (the oldest still sending its request, or slow to read its answer)"
                if shut
                else "turned a new one away, every one answering a request",
                f" ({left_out} more since the last such line)" if left_out else "",
            )
        if shut is None:
            return False
        self._closing.add(shut)
        with contextlib.suppress(OSError):
            shut.shutdown(socket.SHUT_RDWR)
        return True

    def answering(self, request: socket.socket) -> None:
        with self._lock:
            if request in self._held:
                self._held[request] = time.monotonic()

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._held.pop(request, None)
            self._closing.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out or went away: nothing to print (socketserver writes a traceback to stderr).
        pass


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    """/metrics over HTTP on a daemon thread, a thread per connection, each cut after METRICS_READ_TIMEOUT_S, at
    most METRICS_CONNECTIONS of them at once."""
    host = host.strip("[]")  # `[::]` as well as `::`: getaddrinfo takes the address without brackets
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (_Server,), {"address_family": family})
    httpd: WSGIServer = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return httpd, thread


class Metrics:
    """Every metric the server exports; names are part of the contract with dashboards and `mhaserve bench`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mhaserve_requests",
            "Requests answered (gRPC calls and HTTP requests), by method or route and gRPC status code",
            ["method", "code"],
            registry=r,
        )
        self.request_duration = Histogram(
            "mhaserve_request_duration_seconds",
            "Time from receiving a request (gRPC call or HTTP request) to answering it",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stream_responses = Counter(
            "mhaserve_stream_responses",
            "Responses within streams (EncodeStream, ModelStreamInfer, tei.v1's), by method and each one's status",
            ["method", "code"],
            registry=r,
        )
        self.in_flight = Gauge(
            "mhaserve_requests_in_flight", "Requests being handled now (gRPC calls and HTTP requests)", registry=r
        )
        self.incoming = Gauge(
            "mhaserve_incoming_request_bytes",
            "Request bytes held while they arrive (HTTP bodies, the lean gRPC front's messages), against "
            "--max-incoming-bytes",
            registry=r,
        )
        self.incoming_limit = Gauge(
            "mhaserve_incoming_request_bytes_limit",
            "--max-incoming-bytes: past it, a request whose bytes are still arriving is refused (RESOURCE_EXHAUSTED, "
            "HTTP 429)",
            registry=r,
        )
        self.connections = Gauge(
            "mhaserve_connections",
            "Client connections open (the lean gRPC front's and HTTP's), against --max-connections",
            registry=r,
        )
        self.connections_limit = Gauge(
            "mhaserve_connections_limit",
            "--max-connections: past it, a new connection closes the oldest that has sent no request yet, or "
            "with none such is closed at once (HTTP answers it 503 first)",
            registry=r,
        )
        self.connections_refused = Counter(
            "mhaserve_connections_refused",
            "Connections closed at once because --max-connections were open and none was silent, by protocol",
            ["protocol"],
            registry=r,
        )
        self.connections_closed_silent = Counter(
            "mhaserve_connections_closed_silent",
            "Connections that had sent no request yet, closed at --max-connections to make room for a new "
            "one, by the protocol of the one closed",
            ["protocol"],
            registry=r,
        )
        for protocol in ("grpc", "http"):  # at 0 from the start: a rate or an alert's increase sees the first
            self.connections_refused.labels(protocol)
            self.connections_closed_silent.labels(protocol)
        # What health and readiness report, for alerts: the metrics port answers while the server loads,
        # stalls or drains, so `up` alone does not tell a replica that serves from one that does not.
        self.ready = Gauge(READY, READY_HELP, registry=r)
        by_model = ["model", "version"]
        self.tokenize = Histogram(
            "mhaserve_tokenize_duration_seconds",
            "Tokenisation time per request",
            by_model,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "mhaserve_queue_wait_seconds",
            "Time a request waits in the queue before its first input reaches the model",
            by_model,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "mhaserve_inference_duration_seconds", "Model time per batch", by_model, buckets=LATENCY_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "mhaserve_batch_size", "Inputs per batch", by_model, buckets=SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "mhaserve_batch_tokens", "Tokens per batch, padding included", by_model, buckets=TOKEN_BUCKETS, registry=r
        )
        self.padding_fraction = Histogram(
            "mhaserve_padding_fraction",
            "Share of each batch's tokens that are padding",
            by_model,
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("mhaserve_queue_depth", "Inputs waiting for the model", by_model, registry=r)
        self.provider = Gauge(
            "mhaserve_execution_provider_info",
            "The ONNX Runtime execution provider a model version's session got (value 1)",
            [*by_model, "provider"],
            registry=r,
        )
        self.inputs = Counter("mhaserve_inputs", "Inputs embedded", by_model, registry=r)
        # mhaserve_requests_total has no model label (a name a client typed is no label value); this counts
        # what reached a served version, so that a model's own rate and errors can be told apart.
        self.model_requests = Counter(
            "mhaserve_model_requests",
            "Requests that reached a model version, by the status they ended with",
            [*by_model, "code"],
            registry=r,
        )
        self.stalls = Counter(
            "mhaserve_inference_stalls",
            "Batches that computed past --inference-timeout (the watchdog failed their requests)",
            by_model,
            registry=r,
        )
        self.model_ready = Gauge(
            "mhaserve_model_ready", "1 while a model version is served, 0 once it is unloaded", by_model, registry=r
        )
        self.load_failures = Counter(
            "mhaserve_model_load_failures",
            "Model versions that failed to load (the served version stays; the log and the repository index say why)",
            by_model,
            registry=r,
        )
        # What the copies of each model version hold in common (ModelMetrics): their series go with the last.
        self.copies: dict[tuple[str, str], _Copies] = {}
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    def serve(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the bound port (useful when `port` is 0)."""
        self._http = serve_metrics(self.registry, host, port)
        bound = int(self._http[0].server_port)
        shown = f"[{host.strip('[]')}]" if ":" in host else host  # an IPv6 address, as a URL writes it
        log.info("metrics on http://%s:%d/metrics", shown, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None


def stream_counter(metrics: Metrics | None, method: str) -> Callable[[str], None] | None:
    """What counts one stream method's responses by their status (`rpc.streaming.ordered`), or None."""
    if metrics is None:
        return None
    counter = metrics.stream_responses
    return lambda code: counter.labels(method, code).inc()


@dataclass
class _Copies:
    """The copies of one model version alive at once, and the series only some of them made."""

    alive: int = 0
    codes: set[str] = field(default_factory=set)  # mhaserve_model_requests_total's
    # mhaserve_execution_provider_info's: how many copies served on each provider
    providers: collections.Counter[str] = field(default_factory=collections.Counter)
    # What the copies share beside the series, which goes with them (ModelMetrics.shared)
    shared: dict[str, Any] = field(default_factory=dict)


class ModelMetrics:
    """The metrics of one copy of a model version: what its pipeline and batcher observe, under its labels.

    A version can have two copies at once (one loading while another finishes its queue: a reload, or an
    unload and a load): prometheus gives both the same series, so they go with the last copy (`discard`).
    """

    def __init__(self, metrics: Metrics, model: str, version: int | str) -> None:
        self.parent = metrics
        self.labels = (model, str(version))
        self._copies = metrics.copies.setdefault(self.labels, _Copies())
        self._copies.alive += 1
        self._gone = False
        self.tokenize = metrics.tokenize.labels(*self.labels)
        self.queue_wait = metrics.queue_wait.labels(*self.labels)
        self.inference = metrics.inference.labels(*self.labels)
        self.batch_size = metrics.batch_size.labels(*self.labels)
        self.batch_tokens = metrics.batch_tokens.labels(*self.labels)
        self.padding_fraction = metrics.padding_fraction.labels(*self.labels)
        self.queue_depth = metrics.queue_depth.labels(*self.labels)
        self.inputs = metrics.inputs.labels(*self.labels)
        self.stalls = metrics.stalls.labels(*self.labels)
        self._codes: dict[str, Any] = {}  # mhaserve_model_requests_total's children, by code
        self._provider: str | None = None

    def shared(self, key: str, make: Callable[[], T]) -> T:
        """What every copy of this version alive at once shares under `key` (made by the first one), kept as its
        series are, until its last copy is gone: the KServe statistics of a version loaded again went on from
        its last copy's series (execution_count) but began again at 0 requests."""
        if key not in self._copies.shared:
            self._copies.shared[key] = make()
        made: T = self._copies.shared[key]
        return made

    def ended(self, code: str) -> None:
        """A request that reached this version ended with `code` (a gRPC status name)."""
        child = self._codes.get(code)
        if child is None:
            child = self._codes[code] = self.parent.model_requests.labels(*self.labels, code)
            self._copies.codes.add(code)
        child.inc()

    def served(self, provider: str) -> None:
        self._provider = provider
        self._copies.providers[provider] += 1
        self.parent.provider.labels(*self.labels, provider).set(1)
        self.parent.model_ready.labels(*self.labels).set(1)

    def unloaded(self) -> None:
        """The version is gone: its series go (a dashboard would otherwise show it forever), ready says 0."""
        self.discard()
        self.parent.model_ready.labels(*self.labels).set(0)

    def discard(self) -> None:
        """This copy is gone (closed, or never served: its load failed). The version's series go with its last
        copy: a copy that closed while the next one warmed up took the series the next one then served on."""
        if self._gone:
            return
        self._gone = True
        p, copies = self.parent, self._copies
        copies.alive -= 1
        if self._provider is not None:  # the provider this copy ran on, unless another copy serves there too
            copies.providers[self._provider] -= 1
            if not copies.providers[self._provider]:
                del copies.providers[self._provider]
                p.provider.remove(*self.labels, self._provider)
        if copies.alive:
            return
        del p.copies[self.labels]
        for histogram in (p.tokenize, p.queue_wait, p.inference, p.batch_size, p.batch_tokens, p.padding_fraction):
            histogram.remove(*self.labels)
        p.queue_depth.remove(*self.labels)
        p.inputs.remove(*self.labels)
        p.stalls.remove(*self.labels)
        for code in copies.codes:
            p.model_requests.remove(*self.labels, code)
