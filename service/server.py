"""The server process: composition (settings in, components out) and lifecycle (bind, load, serve, drain, stop).

One process, one event loop: gRPC (encoder.v1, the Open Inference Protocol, health, reflection) and
HTTP (OpenAI embeddings, KServe v2 REST, utility routes) over the same data plane, pipeline, batcher,
limits, keys, TLS material, metrics and drain.

This, the CLI and the supervisor of several server processes (processes.py) are the only code that reads
`Settings`; every component gets plain values.

Start-up binds the port first and reports NOT_SERVING while the model loads and warms up, so an
orchestrator sees a live process that is not ready yet; then SERVING. A process that shares its ports
with others (--reuse-port; each of --processes') binds them once it serves instead. Shutdown (SIGTERM or SIGINT):
health goes NOT_SERVING and new calls are refused with UNAVAILABLE, the batcher stops waiting for
batches to fill, streams waiting for their client's next message are closed (rpc/drain.py), in-flight
and queued requests get the grace period to finish, then the process exits 0. A second signal during the
drain exits at once with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).

Security (auth.py, tls.py): TLS or mutual TLS on the gRPC port, and API keys checked before any handler;
a batch past --inference-timeout makes the server report NOT_SERVING (batching/watchdog.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, MutableSequence
from dataclasses import dataclass

import grpc
import grpc.aio

from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as encoder_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as kserve_grpc
from mhaserve.runtime.cpus import available_cpus
from mhaserve.runtime.engine import Runs
from mhaserve.runtime.errors import ServiceError, Unavailable
from mhaserve.runtime.repository import (
    EngineFactory,
    LoadedModel,
    ModelRepository,
    RepositoryError,
    onnx_engine,
)
from mhaserve.service import connections, tls
from mhaserve.service.auth import OPEN_METHODS, AuthError, KeyRing, Keys, is_open, load_keys
from mhaserve.service.batching import CPU_LIMITS, Batcher
from mhaserve.service.connections import ConnectionLimit
from mhaserve.service.context import Demote
from mhaserve.service.credentials import Credentials
from mhaserve.service.dataplane import DataPlane, State
from mhaserve.service.encoder_v1 import SERVICE as ENCODER_SERVICE
from mhaserve.service.encoder_v1 import EncoderServicer
from mhaserve.service.health import SERVICE_NAME as HEALTH_SERVICE
from mhaserve.service.health import Health
from mhaserve.service.http import app as http_app
from mhaserve.service.http import cors
from mhaserve.service.http.middleware import CallMiddleware
from mhaserve.service.http.server import HttpServer
from mhaserve.service.incoming import Incoming
from mhaserve.service.inflight import InFlight
from mhaserve.service.kserve.servicer import HEALTH_METHODS as KSERVE_HEALTH_METHODS
from mhaserve.service.kserve.servicer import REPOSITORY_METHODS as KSERVE_REPOSITORY_METHODS
from mhaserve.service.kserve.servicer import SERVICE as KSERVE_SERVICE
from mhaserve.service.kserve.servicer import InferenceServicer
from mhaserve.service.metrics import Metrics, ModelMetrics
from mhaserve.service.models import ModelManager, Served
from mhaserve.service.pipeline import TOKENIZE_THREADS, Pipeline
from mhaserve.service.rpc.auth import AuthInterceptor
from mhaserve.service.rpc.drain import Drain, DrainInterceptor
from mhaserve.service.rpc.interceptors import ServiceInterceptor
from mhaserve.service.rpc.lean.server import LeanServer
from mhaserve.service.rpc.methods import SERVICES
from mhaserve.service.rpc.reflection import add_reflection
from mhaserve.service.rpc.registration import GenericOnly
from mhaserve.service.settings import Settings, worker_threads
from mhaserve.service.tei_v1 import NOT_SERVED_SERVICES as TEI_NOT_SERVED
from mhaserve.service.tei_v1 import SERVED_SERVICES as TEI_SERVED
from mhaserve.service.tei_v1 import TeiServicer
from mhaserve.service.threads import CountingPool, named_pool

log = logging.getLogger(__name__)
# grpc.aio logs an ERROR, with a traceback, for each answer it could not write to a stream whose client had
# cancelled it (or whose deadline passed) meanwhile: a client's doing, as many lines as a client likes. At DEBUG;
# the call is counted CANCELLED or DEADLINE_EXCEEDED (rpc/interceptors.py).
CLIENT_GONE = Demote(("ExecuteBatchError raised in core by servicer method",))

MAX_PENDING_CALLS = 20_000
IDLE_CONNECTION_S = 300  # a gRPC connection with no call for this long is closed (GOAWAY)
# Calls a connection may have open at once, on either front (SETTINGS_MAX_CONCURRENT_STREAMS): a client past
# it waits for one to end, and a stream opened past it is refused (REFUSED_STREAM, which clients retry).
# One connection cannot hold more than that of the server's tasks and memory; the queue limit still
# refuses inputs past it across all connections.
MAX_STREAMS = 1000
ABANDON_S = 1.0  # at most this long for the calls still running at the grace period's end to be answered
CONNECTION_AGE_GRACE_S = 300  # with --max-connection-age, what calls in flight get after the GOAWAY
SETTLE_S = 1.0  # the most serve() waits, once stopped, for calls gRPC handed over as it stopped (settle)
# What a request is told while every inference thread holds a batch that has not returned (_stalled).
STARVED = (
    "every inference thread is held by a batch that has not returned (--inference-timeout); "
    "this server reports NOT_SERVING: retry on another replica"
)
# Methods that answer while the model loads and while the server drains: health checks, reflection, and
# the Open Inference Protocol's own health methods (which answer false then). The call interceptor
# neither gates nor counts them.
# ServerMetadata too: it describes the server (its extensions), not the models, and Triton answers it in every
# state; a client that reads the extensions before waiting for readiness would fail for nothing.
ALWAYS_ANSWERED = (
    f"/{HEALTH_SERVICE}/",
    "/grpc.reflection.",
    *KSERVE_HEALTH_METHODS,
    f"/{KSERVE_SERVICE}/ServerMetadata",
)


@dataclass(frozen=True)
class CoreShare:
    """A server process's part of the cores it shares with the other processes of `serve --processes` on a
    CPU: it sizes its inference workers, and the threads of a batch that overlaps another, by its `cpus`; a
    batch that starts while no process computes takes every core. Pinned instead, each process would run a
    lone request on its share alone: on 2 cores, one core for one text, 1.2-4.7 ms slower than one process
    (docs/benchmarks.md). `peers`: every process's runs in progress, in shared memory (runtime.engine.Runs);
    `index`: this process's slot."""

    cpus: int
    peers: MutableSequence[int]
    index: int


def _intra_op_threads(settings: Settings, workers: int, cpus: int, *, shared: bool) -> tuple[int | None, int | None]:
    """ONNX Runtime's threads: for a batch that computes alone, and for one that starts while another
    computes (None: no second session). --intra-op-threads fixes both; otherwise a lone batch gets every core
    and, with several inference workers or processes sharing the cores, an overlapping one its worker's share
    of `cpus` (more threads than cores would only preempt each other)."""
    if settings.intra_op_threads or (workers == 1 and not shared):
        return settings.intra_op_threads, None
    return None, worker_threads(cpus, workers)


def _threads_in_words(alone: int | None, overlapping: int | None) -> str:
    words = f"{alone or _all_cores()}"
    return words if overlapping is None else f"{words} alone, {overlapping} while another batch computes"


def _all_cores() -> str:
    """'all N cores', and what the host has when the process may use fewer (an affinity mask, a cgroup quota)."""
    usable, host = available_cpus(), os.cpu_count() or 1
    return f"all {usable} cores" + (f" (of the host's {host}: affinity or cgroup quota)" if usable < host else "")


class StartupError(RuntimeError):
    """The server cannot start: the message says why and what to do."""


def _unreadable(e: OSError) -> str:
    """A repository's file that could not be read, in one line: which, why, and where this user may not read
    it, as whom."""
    what = f"cannot read {e.filename}: {e.strerror or e}" if e.filename else f"cannot read the model repository: {e}"
    if e.errno in (errno.EACCES, errno.EPERM):
        what += f" (this server runs as uid {os.getuid()}: the repository's folders and files must be readable by it)"
    return what


def _connection_limit(setting: int | None) -> int:
    """--max-connections, or its default for this process's open-file limit, raised first to the hard limit."""
    before, files = connections.raise_file_limit()
    connections.throttle_accept_failures()
    if before != files:
        log.info("raised the limit of open files from %d to %d (the hard limit)", before, files)
    if setting is None:
        return connections.default_limit(files)
    if setting > files - connections.RESERVE:
        log.warning(
            "--max-connections %d leaves fewer than %d of the %d files this process may open for its own use: "
            "past %d connections, accepting one may fail (raise the hard limit, `ulimit -Hn`, or lower the setting)",
            setting,
            connections.RESERVE,
            files,
            max(0, files - connections.RESERVE),
        )
    return setting


def grpc_address(host: str, port: int) -> str:
    """HOST:PORT as grpc reads it and as a log line shows it: an IPv6 address (`::`, `::1`, or bracketed
    already) in brackets."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def read_credentials(settings: Settings) -> Credentials:
    """The keys and TLS material of `settings`' files and variables, read and checked (AuthError, TlsError):
    by a server as it starts, or by the supervisor of --processes N for all of its processes."""
    s = settings
    admin = load_keys(s.admin_keys_file, s.admin_keys.keys, env="MHASERVE_ADMIN_KEYS", flag="--admin-keys-file")
    return Credentials(
        Keys(KeyRing(load_keys(s.api_keys_file, s.api_keys.keys)), KeyRing(admin)),
        tls.TlsMaterial.read(tls.TlsFiles(s.tls_cert, s.tls_key, s.tls_client_ca)),
    )


class EncoderServer:
    """The server: the models of a repository over gRPC (encoder.v1, the Open Inference Protocol, health,
    reflection) and HTTP (OpenAI's embeddings, KServe REST, /tokenize, /info, /health), and Prometheus metrics."""

    def __init__(
        self,
        settings: Settings,
        *,
        engine_factory: EngineFactory | None = None,
        metrics: Metrics | None = None,
        share: CoreShare | None = None,
        pinned: Served | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        """`share`: this process's part of cores shared with other server processes (None: all are its own);
        `pinned`: the versions those others serve, to serve them as they do (ModelManager); `credentials`: the
        keys and TLS material their supervisor read at start-up, to serve with (None: read them here, in start())."""
        self.settings = settings
        self.credentials = credentials
        cpus = available_cpus() if share is None else share.cpus
        self.workers = settings.workers_on(cpus)
        self.threads = _intra_op_threads(settings, self.workers, cpus, shared=share is not None)
        runs = None if share is None else Runs(share.peers, share.index)
        self.engine_factory = engine_factory or onnx_engine(settings.device, *self.threads, runs=runs)
        self.metrics = metrics or Metrics()
        self.repository = ModelRepository(settings.repository)
        # At most as many calls wait for the model as the queue would take inputs.
        self.dataplane = DataPlane(
            loading_wait=settings.loading_wait, max_held=settings.max_queue_size or CPU_LIMITS.max_queue_size
        )
        self.health = Health([ENCODER_SERVICE, KSERVE_SERVICE, *TEI_SERVED], self.metrics.ready, never=TEI_NOT_SERVED)
        self.port = 0
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.in_flight = InFlight()  # calls of both protocols: the drain waits for none
        # Request bytes held while they arrive, over HTTP and the lean gRPC front together (incoming.py)
        assert settings.max_incoming_bytes is not None  # Settings resolves it
        self.incoming = Incoming(settings.max_incoming_bytes)
        self.metrics.incoming.set_function(lambda: self.incoming.held)
        self.metrics.incoming_limit.set(self.incoming.limit)  # for a dashboard's or an alert's ratio
        # Client connections over both fronts, against the descriptors the process may hold (connections.py)
        self.connection_limit = ConnectionLimit(
            _connection_limit(settings.max_connections),
            refused=self.metrics.connections_refused,
            closed_silent=self.metrics.connections_closed_silent,
        )
        self.metrics.connections.set_function(lambda: self.connection_limit.open)
        self.metrics.connections_limit.set(self.connection_limit.limit)
        self._server: grpc.aio.Server | LeanServer | None = None
        self._calls: ServiceInterceptor | None = None  # the gRPC calls' bookkeeping, which can abandon them
        self._requests: CallMiddleware | None = None  # the HTTP requests' (http/middleware.py), which can too
        self._http: HttpServer | None = None
        self.manager = ModelManager(
            self.repository,
            self.dataplane,
            self.metrics,
            models=settings.model,
            graph=settings.graph,
            engine_factory=self.engine_factory,
            make_pipeline=self._pipeline,
            control=settings.model_control,
            device=settings.device,
            pinned=pinned,
        )
        # The inference threads every model's batches take turns on (see Batcher's executor), and the
        # tokeniser threads every model shares.
        self._inference = CountingPool("inference", self.workers)
        self._tokenize = named_pool("tokenize", TOKENIZE_THREADS)
        self._stalls = 0
        self._loading: asyncio.Task[None] | None = None
        self._listening: Callable[[], Awaitable[None]] | None = None  # binds the ports (start() decides when)
        self._drain = Drain()

    @property
    def state(self) -> State:
        return self.dataplane.state

    @state.setter
    def state(self, value: State) -> None:
        self.dataplane.state = value

    @property
    def pipeline(self) -> Pipeline | None:
        """The default model's latest pipeline, once loaded."""
        default = self.dataplane.default_model
        return self.dataplane.resolve(default) if self.dataplane.versions(default) else None

    @property
    def model(self) -> LoadedModel | None:
        return None if self.pipeline is None else self.pipeline.model

    async def start(self) -> None:
        """Find and verify the models, bind the ports, and start loading; `ready()` waits for the rest.

        A server that shares its ports with others (--reuse-port, as each of --processes' are) binds them
        only once it serves instead: the kernel would hand it connections while it loads, which the others
        could have answered."""
        s = self.settings
        try:
            names = self.manager.names() or [self.manager.default_name()]
            for name in filter(self.manager.must_serve, names):  # every model named verifies: fail fast
                version = self.manager.to_serve(name)[-1]
                try:
                    self.repository.entry(name, version, graph=s.graph, device=s.device)
                except (RepositoryError, OSError):
                    # under poll an older version may serve in its place (ModelManager._fall_back): the load says
                    if not self.manager.may_fall_back(name):
                        raise
        except ServiceError as e:
            raise StartupError(e.message) from None
        except RepositoryError as e:  # malformed, tampered with, incomplete
            raise StartupError(str(e)) from None
        except OSError as e:  # a file this user cannot read (exported under umask 077, the image's uid 10001)
            raise StartupError(_unreadable(e)) from None
        try:
            credentials = read_credentials(s) if self.credentials is None else self.credentials
        except (AuthError, tls.TlsError) as e:
            raise StartupError(str(e)) from None
        await self.health.set(False)
        self._listening = functools.partial(self._listen, names, credentials)
        if not s.reuse_port:
            await self._listening()
        if s.metrics_port:
            try:
                self.metrics_port = self.metrics.serve(s.metrics_address, s.metrics_port)
            except (OSError, UnicodeError) as e:  # (IDNA refuses a name like "bad..host": a traceback)
                await self._stop_listeners(0)
                why = e.strerror if isinstance(e, OSError) else f"not a host name ({e})"
                raise StartupError(f"cannot serve metrics on {s.metrics_address}:{s.metrics_port}: {why}") from None
        self.state = "loading"
        self._loading = asyncio.get_running_loop().create_task(self._load(), name="load-models")

    async def _listen(self, names: list[str], credentials: Credentials) -> None:
        """Bind and serve the gRPC port and the HTTP port."""
        s = self.settings
        keys = credentials.keys
        mode = tls.TlsFiles(s.tls_cert, s.tls_key, s.tls_client_ca).mode  # for the log
        # Order matters: authentication first (a refused call touches nothing else), then the error map,
        # then the drain wrapper right around the handlers.
        auth = (
            [AuthInterceptor(keys, s.open_methods, self.metrics, admin_methods=KSERVE_REPOSITORY_METHODS)]
            if keys.enabled
            else []
        )
        calls = ServiceInterceptor(
            self.metrics,
            self.dataplane.admission,
            exempt=ALWAYS_ANSWERED,
            in_flight=self.in_flight,
            control=KSERVE_REPOSITORY_METHODS,
            control_gate=functools.partial(self.dataplane.admission, control=True),
        )
        self._calls = calls
        interceptors = [*auth, calls, DrainInterceptor(self._drain, exempt=ALWAYS_ANSWERED)]
        server: grpc.aio.Server | LeanServer
        if s.grpc_front == "lean":
            server = LeanServer(
                interceptors,
                max_message_bytes=s.max_message_bytes,
                # The methods open by default (--open-methods): probes and reflection, whose requests are a name
                probe_methods=OPEN_METHODS,
                incoming=self.incoming,
                message_timeout=s.http_header_timeout,
                max_streams=MAX_STREAMS,
                handshake_timeout=s.http_header_timeout,
                idle_s=IDLE_CONNECTION_S,
                max_age_s=s.max_connection_age,
                max_age_grace_s=CONNECTION_AGE_GRACE_S,
                reuse_port=s.reuse_port,
                connection_limit=self.connection_limit,
                refused=calls.refused,
            )
        else:
            cygrpc = logging.getLogger("grpc._cython.cygrpc")
            if CLIENT_GONE not in cygrpc.filters:  # once: servers in one process share the logger
                cygrpc.addFilter(CLIENT_GONE)
            server = grpc.aio.server(
                interceptors=interceptors,
                options=[
                    ("grpc.max_receive_message_length", s.max_message_bytes),
                    # A port in use is an error, not a silent share, unless shared on purpose (--processes).
                    ("grpc.so_reuseport", int(s.reuse_port)),
                    # grpc core advertises no limit of its own.
                    ("grpc.max_concurrent_streams", MAX_STREAMS),
                    # gRPC sheds calls the service has not picked up yet past 1000 (at random) and 3000, with
                    # CANCELLED, a code clients read as their own doing. Let the queue limit decide instead
                    # (RESOURCE_EXHAUSTED, at once); these only bound a flood faster than the event loop.
                    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                    ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
                    # A connection that has not finished its HTTP/2 preface and settings within the same time as
                    # an HTTP client's headers is closed (gRPC's default, 120 s, let a few hundred silent
                    # connections hold every file descriptor); one with no call for IDLE_CONNECTION_S gets a
                    # GOAWAY, which clients answer by connecting again at their next call.
                    ("grpc.server_handshake_timeout_ms", int(s.http_header_timeout * 1000)),
                    ("grpc.max_connection_idle_ms", IDLE_CONNECTION_S * 1000),
                    # --max-connections: grpc core accepts the connections of this front, so it counts them itself.
                    ("grpc.max_allowed_incoming_connections", self.connection_limit.limit),
                    # --max-connection-age: a connection's GOAWAY after that long (grpc adds up to 10 % of jitter,
                    # so that replicas' clients do not all reconnect at once), then CONNECTION_AGE_GRACE_S for
                    # the calls in flight: a stream open longer than both is cut and its client starts another.
                    *(
                        [
                            ("grpc.max_connection_age_ms", int(s.max_connection_age * 1000)),
                            ("grpc.max_connection_age_grace_ms", CONNECTION_AGE_GRACE_S * 1000),
                        ]
                        if s.max_connection_age
                        else []
                    ),
                ],
            )
        # Generic handlers only: a registered method costs grpc.aio's accept loop a turn over every method
        # at every call (rpc/registration.py). encoder.v1 first: it is the first handler asked for a method.
        services = GenericOnly(server)
        encoder_grpc.add_EncoderServiceServicer_to_server(
            EncoderServicer(self.dataplane, max_message_bytes=s.max_message_bytes, metrics=self.metrics), services
        )
        # The Open Inference Protocol (KServe v2 / Triton clients) on the same port, over the same data plane.
        kserve = InferenceServicer(self.dataplane, self.manager, self.metrics)
        kserve_grpc.add_GRPCInferenceServiceServicer_to_server(kserve, services)
        self.health.add_to(services)
        # text-embeddings-inference's gRPC API, for its clients, over the same data plane.
        TeiServicer(self.dataplane, metrics=self.metrics).add_to(services)
        add_reflection(services, SERVICES)  # what --open-methods is checked against (rpc/methods.py)
        address = grpc_address(s.host, s.port)
        try:
            if credentials.tls is None:
                self.port = server.add_insecure_port(address)
            elif isinstance(server, LeanServer):
                self.port = server.add_secure_port(address, tls.server_ssl_context(credentials.tls, alpn=["h2"]))
            else:
                self.port = server.add_secure_port(address, tls.server_credentials(credentials.tls))
        except (RuntimeError, OSError) as e:
            if isinstance(server, LeanServer):  # it knows the reason: the OS's, or the TLS files'
                raise StartupError(
                    str(e) if isinstance(e, RuntimeError) else f"cannot listen on {address}: {e}"
                ) from None
            # grpc says only that it failed (its reason goes to its own log line)
            raise StartupError(
                f"cannot listen on {address} (in use, not an address of this host, or a TLS key that does not "
                "match its certificate)"
            ) from None
        await server.start()
        self._server = server
        front = "the lean gRPC front" if isinstance(server, LeanServer) else "grpc.aio"
        if s.reuse_port:
            log.info(
                "listening on %s, %s, %s, beside other processes (SO_REUSEPORT)",
                grpc_address(s.host, self.port),
                mode,
                front,
            )
        else:
            log.info(
                "listening on %s, %s, %s (NOT_SERVING until %s %s loaded and warmed up; calls meanwhile %s)",
                grpc_address(s.host, self.port),
                mode,
                front,
                ", ".join(names),
                "is" if len(names) == 1 else "are",
                f"wait for it up to {s.loading_wait:g} s (--loading-wait)" if s.loading_wait > 0 else "are refused",
            )
        self._log_security(keys)
        if s.http_port:
            await self._start_http(keys, credentials.tls, mode)

    async def _start_http(self, keys: Keys, material: tls.TlsMaterial | None, mode: str) -> None:
        s = self.settings
        app = http_app.build(
            self.dataplane,
            metrics=self.metrics,
            in_flight=self.in_flight,
            keys=keys,
            manager=self.manager,
            max_body_bytes=s.max_message_bytes,
            read_timeout=s.http_header_timeout,
            incoming=self.incoming,
        )
        self._requests = app
        self._http = HttpServer(
            cors.allowing(app, s.cors_allow_origin) if s.cors_allow_origin else app,
            host=s.host,
            port=s.http_port,
            tls_context=None if material is None else tls.server_ssl_context(material),
            read_timeout=s.http_header_timeout,
            reuse_port=s.reuse_port,
            connection_limit=self.connection_limit,
        )
        try:
            self.http_port = self._http.bind()
            await self._http.start()
        except OSError as e:
            self._http = None
            await self._stop_listeners(0)
            raise StartupError(f"cannot serve HTTP on {s.host}:{s.http_port}: {e.strerror or e}") from None
        log.info(
            "HTTP on %s, %s: OpenAI /v1/embeddings, KServe /v2, TEI /embed, /docs",
            grpc_address(s.host, self.http_port),
            mode,
        )

    async def _stop_listeners(self, grace: float) -> None:
        """Stop both ports at once (gRPC's GOAWAY, HTTP's closed connections); wait for what is in flight."""
        stops = []
        if self._server is not None:
            stops.append(self._server.stop(grace))
            self._server = None
        if self._http is not None:
            stops.append(self._http.stop(grace))
            self._http = None
        await asyncio.gather(*stops)

    def _log_security(self, keys: Keys) -> None:
        s = self.settings
        if keys.enabled:
            log.info(
                "API keys required (%d configured, %d admin); open without a key: %s%s",
                len(keys.client),
                len(keys.admin),
                ", ".join(s.open_methods) or "none",
                # /inference.GRPCInferenceService/* opens all of it but these (rpc/auth.py)
                " (but the repository API, which wants an admin key)"
                if any(is_open(m, s.open_methods) for m in KSERVE_REPOSITORY_METHODS)
                else "",
            )
        else:
            # Said at start-up, so that a secret that rendered empty (MHASERVE_API_KEYS="") is seen, not assumed.
            log.info("API keys: none configured; every method and route is open (--api-keys-file, MHASERVE_API_KEYS)")
        if s.tls_cert is None and not tls.is_loopback(s.host):
            log.warning(
                "serving plaintext gRPC on %s, which is not a loopback address: traffic%s can be read on the "
                "network; set --tls-cert and --tls-key",
                s.host,
                " and API keys" if keys.enabled else "",
            )

    async def ready(self) -> None:
        """Wait until the model serves; raises what made loading fail."""
        if self._loading is None:
            raise RuntimeError("start() first")
        await asyncio.shield(self._loading)

    async def _load(self) -> None:
        s = self.settings
        await self.manager.start()
        if s.model_control == "poll":
            self.manager.start_polling(s.repository_poll_s)
        log.info(
            "serving %s (requests that name no model get %s); batching %s, model control %s, "
            "%d inference worker(s)%s, ONNX Runtime intra-op threads per batch: %s",
            ", ".join(
                f"{n} version {', '.join(map(str, self.dataplane.versions(n)))}" for n in self.dataplane.model_names()
            ),
            self.dataplane.default_model,
            s.batching,
            s.model_control,
            self.workers,
            "" if s.inference_workers else " (auto)",
            _threads_in_words(*self.threads),
        )
        if self.state == "loading":
            self.state = "serving"
            await self.health.set(True)
            if s.reuse_port:
                assert self._listening is not None
                await self._listening()

    def _pipeline(self, model: LoadedModel, metrics: ModelMetrics) -> Pipeline:
        """A model version's pipeline: its limits (its own, the server's, the device's), its batcher."""
        s = self.settings
        limits = s.limits(on_cuda=model.on_cuda, model=model.entry.config.limits)
        batcher = Batcher(
            model.engine,
            limits=limits,
            batching=s.batching,
            pad_id=model.entry.manifest.pad_id,
            metrics=metrics,
            executor=self._inference,
            inference_timeout=s.inference_timeout,
            on_stall=self._stalled,
            on_recover=self._recovered,
            workers=self.workers,
            starved=self._starved,
        )
        return Pipeline(model, batcher, limits, metrics, auto_truncate=s.auto_truncate, tokenize_pool=self._tokenize)

    async def _stalled(self) -> None:
        self._stalls += 1
        if self._stalls >= self.workers:
            # Every inference thread holds a batch that has not returned: what waits for one, in any model's
            # batcher (they share the threads), can no longer run, nor what comes. Its own batcher failed its
            # queue; the others' requests would wait for as long as the engine hangs (for ever, without a
            # deadline), those queued and those that passed the server's gate before it (a stream's next
            # message, a body still arriving, a server in --drain-delay, which keeps its state).
            for pipeline in self.manager.pipelines():
                pipeline.batcher.fail_waiting(Unavailable(STARVED))
        if self.state == "serving":
            self.state = "stalled"
            await self.health.set(False)

    def _starved(self) -> str | None:
        """What a model's request is told while every inference thread holds a stalled batch; None otherwise."""
        return STARVED if self._stalls >= self.workers else None

    async def _recovered(self) -> None:
        self._stalls -= 1
        if self.state == "stalled" and self._stalls == 0:
            self.state = "serving"
            await self.health.set(True)

    async def unready(self, delay: float) -> None:
        """Report NOT_SERVING, and go on serving for `delay` seconds: the time balancers and endpoint
        controllers need to see it and stop sending here, before anything is refused."""
        if self.state not in ("serving", "stalled", "loading") or delay <= 0:
            return
        self.state = "unready"
        await self.health.set(False)
        log.debug("NOT_SERVING for %g s (--drain-delay) while serving on, so balancers move away first", delay)
        await asyncio.sleep(delay)

    async def drain(self) -> None:
        """Refuse new calls and report NOT_SERVING; queued work goes to the model without waiting."""
        if self.state in ("draining", "stopped"):
            return
        self.state = "draining"
        await self.health.shutdown()
        self._drain.begin()  # after NOT_SERVING is set, so health watchers get it before their stream ends
        for pipeline in self.dataplane.pipelines():
            pipeline.batcher.drain()

    async def _quiesce(self, grace: float) -> float:
        """Wait (at most `grace` s) until no model call is in flight; return the grace left.

        When gRPC stops, it fails the calls it has received but not yet handed to the service with
        CANCELLED (grpc/grpc#41785). Until the work in flight is done the server keeps taking calls, and
        the gate answers the new ones UNAVAILABLE, so a call sent before the drain is answered, not cancelled.
        """
        deadline = time.monotonic() + grace
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):  # not wait_for, which can swallow a cancellation (Batcher)
                await self.in_flight.idle.wait()
        await asyncio.sleep(max(0.0, min(0.05, deadline - time.monotonic())))  # calls already received get their turn
        return max(0.0, deadline - time.monotonic())

    async def _abandon(self, grace: float) -> None:
        """The grace period is over: answer the gRPC calls still running UNAVAILABLE, with a message that says
        why (grpc's stop would cancel them: "Cancelling all calls", counted CANCELLED, as if their clients had
        gone), as the HTTP requests still running are answered 503 (http/middleware.py)."""
        if self.in_flight.count:  # what an operator looks for when clients report UNAVAILABLE at a deploy
            log.warning(
                "the grace period (%g s) ended with %d request(s) unanswered: they are answered UNAVAILABLE "
                "(retry); --grace-period gives them longer",
                grace,
                self.in_flight.count,
            )
        tasks = [] if self._requests is None else self._requests.abandon()
        if self._calls is not None:
            tasks += self._calls.abandon(
                Unavailable("the server stopped before this call was answered (its grace period ended); retry")
            )
        if not tasks:
            return
        await asyncio.wait(tasks, timeout=ABANDON_S)
        await asyncio.sleep(0.05)  # the answers' trailers reach the socket before the ports close

    async def stop(self, grace: float | None = None, *, delay: float = 0.0) -> None:
        """Drain, give in-flight calls `grace` seconds (default: the settings'), then release everything.

        With a `delay` (--drain-delay, on SIGTERM), the server first reports NOT_SERVING and serves on for
        that long; then, balancers having moved away, it refuses what still comes at the HTTP/2 and HTTP
        level (GOAWAY, closed connections), which clients and proxies retry elsewhere by themselves,
        rather than answer it UNAVAILABLE, which they pass on. Without one (no balancer was told), it
        answers new calls UNAVAILABLE until the calls in flight are done, then stops.
        """
        grace = self.settings.grace_period if grace is None else grace
        if delay > 0 and self.state in ("serving", "stalled"):
            await self.unready(delay)
            # Stop listening now, while still serving what was sent before the GOAWAY reached its sender.
            self.state = "closing"
            self._drain.begin()
            for pipeline in self.dataplane.pipelines():
                pipeline.batcher.drain()
            # The ports wait a little past the grace period: what still runs then is answered by _abandon
            # first, rather than cancelled by grpc's stop.
            stopping = asyncio.ensure_future(self._stop_listeners(grace + ABANDON_S))
            if await self._quiesce(grace) <= 0:
                await self._abandon(grace)
            await stopping
        await self.drain()
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        if self._server is not None or self._http is not None:
            left = await self._quiesce(grace)
            if left <= 0:
                await self._abandon(grace)
            await self._stop_listeners(left)
        await self.manager.close()
        self._inference.shutdown(wait=False, cancel_futures=True)
        self._tokenize.shutdown(wait=False, cancel_futures=True)
        # Off the loop: its HTTP server's shutdown waits for the serving thread's next poll (up to 0.5 s), and
        # a second SIGTERM or Ctrl-C that came meanwhile was never handled (run_server: exit 0, not 143 or 130).
        await asyncio.to_thread(self.metrics.close)
        self.state = "stopped"

    @property
    def stuck(self) -> bool:
        """An inference call is still running once the server has stopped: stalled past the watchdog, or still
        computing when the grace period ended (its thread would hold the process's exit)."""
        return self._inference.running > 0 or any(p.batcher.stalled for p in self.dataplane.pipelines())


async def serve(
    settings: Settings,
    *,
    engine_factory: EngineFactory | None = None,
    on_serving: Callable[[Served], None] | None = None,
    share: CoreShare | None = None,
    exit_now: signal.Signals | None = None,
    pinned: Served | None = None,
    credentials: Credentials | None = None,
) -> int:
    """`mhaserve serve`: run until SIGTERM or SIGINT, drain, and return the exit status. `on_serving` is
    called once every model is loaded and warm, with what is served (how a supervisor of several processes
    learns it); `share`: the cores this process shares with the supervisor's others (see CoreShare); `pinned`:
    what they serve, for a process started again beside them (ModelManager); `credentials`: the keys and TLS
    material the supervisor read at start-up, for every process it starts (None: read as the server starts).

    `exit_now` (in a process of --processes N): SIGTERM and SIGINT drain however often they come, and only
    this signal, the supervisor's word for its own second signal, exits at once. Such a process gets SIGTERM
    twice without anyone asking twice: from the supervisor and from systemd or `pkill` that signalled every
    process, or Linux's death signal again as it is handed from one of a killed supervisor's threads to the
    next; each once cut its requests in flight (exit 143)."""
    server = EncoderServer(settings, engine_factory=engine_factory, share=share, pinned=pinned, credentials=credentials)
    try:
        await server.start()
    except StartupError as e:
        log.error("cannot start: %s", e)
        return 1
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def signalled(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled, sig)
    if exit_now is not None:
        loop.add_signal_handler(exit_now, _exit_now, exit_now, True)
    try:
        ready = asyncio.ensure_future(server.ready())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait((ready, stopping), return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is not None:
            error = ready.exception()
            log.error("cannot serve: %s", getattr(error, "message", error))
            stopping.cancel()
            await server.stop(0)
            return 1
        if ready.done() and on_serving is not None:
            on_serving(server.manager.served())
        await stopping
        for sig in (signal.SIGTERM, signal.SIGINT):
            if exit_now is not None:
                loop.add_signal_handler(sig, log.debug, "%s again while draining: draining still", sig.name)
            else:
                loop.add_signal_handler(sig, _exit_now, sig, False)
        # SIGTERM is an orchestrator's: the drain delay lets its balancers see NOT_SERVING first. SIGINT is
        # a person's Ctrl-C: no one to wait for.
        delay = settings.drain_delay if received[:1] == [signal.SIGTERM] else 0.0
        log.info(
            "shutting down: %sdraining for up to %g s (a second signal exits at once)",
            f"NOT_SERVING for {delay:g} s, then " if delay else "",
            settings.grace_period,
        )
        await server.stop(delay=delay)
        with contextlib.suppress(BaseException):
            await ready
        await settle(SETTLE_S)
        if server.stuck:
            # The stuck inference thread would hold the interpreter's exit forever (it joins its threads).
            log.error(
                "stopped with an inference call still running (stuck, or past the grace period); exiting "
                "without waiting for it"
            )
            logging.shutdown()
            os._exit(1)
        reading, loading = server.manager.busy
        if reading or loading:
            # A read of the model repository, or a load's step (its check reads every byte of the graph), held up
            # by its file system (a network file system that stalls) would hold the exit as long, maybe for ever,
            # as a stuck inference thread does; so would a load longer than the stop. Neither changes what was
            # served, and the stop is done: the exit is a clean one.
            left = []
            if reading:
                left.append(f"{reading} read{'' if reading == 1 else 's'} of the model repository")
            if loading:
                left.append(f"{loading} step{'' if loading == 1 else 's'} of a load (a check of a version's files, "
                            "its session or its warm-up)")  # fmt: skip
            log.warning(
                "stopped with %s still running (%s: a load longer than the stop, or a file system that does not "
                "answer); exiting without waiting",
                " and ".join(left),
                server.manager.repository.root,
            )
            logging.shutdown()
            os._exit(0)
        # A second signal that came while the loop ran something that does not yield is handled now, before its
        # handler goes and before "stopped" is said: the loop reads it on one turn, queues the handler on the next
        # and runs it on the third.
        for _ in range(3):
            await asyncio.sleep(0)
        log.info("stopped")
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, *([exit_now] if exit_now is not None else [])):
            loop.remove_signal_handler(sig)


async def settle(seconds: float) -> None:
    """Let the calls that gRPC handed over as it stopped finish: the gate refuses each UNAVAILABLE at once.
    Left to asyncio.run's close, they are cancelled mid-answer, and gRPC logs each one as an unhandled
    error with a traceback (seen under SIGTERM with clients sending). After a stop with no such call in
    the last instant, no task is left, and this returns at once (but for a stalled batch's recovery, which
    waits for its engine: then it waits the whole `seconds`)."""
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=seconds)


def _exit_now(sig: signal.Signals, supervisor: bool) -> None:
    """A second SIGTERM or SIGINT while draining (under a supervisor, its word for its own): exit now, as a
    shell reports a process killed by it."""
    what = "the supervisor's second signal" if supervisor else f"second {sig.name}"
    log.warning("%s while draining: exiting now, without waiting for in-flight requests", what)
    logging.shutdown()
    os._exit(128 + sig.value)
