"""grpc.health.v1 for the whole server and each gRPC service it serves, set together.

Orchestrators ask for the server ("") or for one service by name; both must say the same thing, so the
status is only ever set here, for all of them at once. The services a client may ask about that this server
has no model for (tei.v1's Predict and Rerank) are NOT_SERVING whatever its state, as TEI reports them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Gauge

from mhaserve.service.rpc.registration import GenericOnly

SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Open Watch streams a process holds at most. Watch is open without a key, and its only bound was 1000 streams a
# connection times --max-connections: 40,000 held by one client with no key took the server's RSS up 300 MB (7.5 KB
# a watch on the lean front, 30 KB on grpc.aio's) and stalled health checks for seconds. Probes ask with Check
# (Kubernetes' grpc probe, Envoy's, `mhaserve health`); a gRPC client that balances with health checking holds a
# Watch a channel (gRFC A17). Past the bound a Watch is answered UNIMPLEMENTED, which such a client reads as "no
# health checking here": it calls the replica as healthy. RESOURCE_EXHAUSTED, the first answer, marked the replica
# unhealthy to every client past the bound, and one connection holding 1000 watches cut them all off.
MAX_WATCHES = 1000


class _Servicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: Check, Watch and List (added to the protocol in 2024, which grpcio's servicer leaves
    UNIMPLEMENTED).

    Not grpcio's aio servicer: its Watch writes each status holding the lock every change of status needs, so one
    client that reads nothing (an HTTP/2 window of 0; Watch is open without a key) held the status where it was:
    NOT_SERVING after the model loaded, and a SIGTERM's drain waited on it past --grace-period. Here a change is
    made at once and each watcher writes the latest on its own time; a watcher that cannot keep up skips the
    statuses between (what a watcher wants is the one now)."""

    def __init__(self) -> None:
        self._status: dict[str, health_pb2.HealthCheckResponse.ServingStatus.ValueType] = {}
        self._watchers: dict[str, set[asyncio.Event]] = {}
        self._watching = 0  # open Watch streams, all services together: MAX_WATCHES bounds them
        self._final = False

    def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        if self._final:
            return
        self._status[service] = status
        for changed in self._watchers.get(service, ()):
            changed.set()

    def shut_down(self) -> None:
        """NOT_SERVING for every service, for good."""
        for service in self._status:
            self.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._final = True

    def watching(self) -> int:
        return self._watching

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        if self._watching >= MAX_WATCHES:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,  # a health-checking client: healthy, unwatched (see MAX_WATCHES)
                f"no more watching: the server holds {MAX_WATCHES} watches, as many as it takes; use Check",
            )
        changed = asyncio.Event()
        self._watchers.setdefault(request.service, set()).add(changed)
        self._watching += 1  # let go in the finally, however the watch ends (cancelled, deadline, server stopping)
        last = None
        try:
            while True:
                changed.clear()  # before the read: a change while this writes is seen at the next turn
                status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if status != last:
                    try:
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                    except Exception:
                        # A write fails only once the call is over (grpc.aio: ExecuteBatchError, as its client cancels,
                        # before grpc.aio has heard of the cancel and can say so): no one is left to tell, so the watch
                        # ends here. Raised, it was an ERROR, "Task exception was never retrieved", each time the
                        # cancel then stopped the drain's wrapper (rpc/drain.py) before it read the watch's end.
                        return
                    last = status
                await changed.wait()
        finally:
            self._watching -= 1
            watchers = self._watchers[request.service]
            watchers.discard(changed)
            if not watchers:
                del self._watchers[request.service]

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> health_pb2.HealthListResponse:
        response = health_pb2.HealthListResponse()
        for service, status in self._status.items():
            response.statuses[service].status = status
        return response


class Health:
    """The health servicer, and the one way to change what it reports."""

    def __init__(self, services: Sequence[str], gauge: Gauge | None = None, *, never: Sequence[str] = ()) -> None:
        self.servicer = _Servicer()
        self.services = ("", *services)
        self.never = tuple(never)  # NOT_SERVING always
        self.gauge = gauge  # mhaserve_ready: what this reports, for Prometheus
        if gauge is not None:
            gauge.set(0)
        for service in (*self.services, *self.never):
            self.servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def add_to(self, server: GenericOnly) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if self.gauge is not None:
            self.gauge.set(int(serving))
        for service in self.services:
            self.servicer.set(service, status)
        for service in self.never:
            self.servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def shutdown(self) -> None:
        """NOT_SERVING for good: watchers get it, and no later set() changes it."""
        if self.gauge is not None:
            self.gauge.set(0)
        self.servicer.shut_down()
