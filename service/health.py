"""grpc.health.v1 for the whole server and each gRPC service it serves, set together.

Orchestrators ask for the server ("") or for one service by name; both must say the same thing, so the
status is only ever set here, for all of them at once. The services a client may ask about that this server
has no model for (tei.v1's Predict and Rerank) are NOT_SERVING whatever its state, as TEI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import Gauge

from mhaserve.service.rpc.registration import GenericOnly

SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class _Servicer(health_aio.HealthServicer):
    """grpcio's servicer, with grpc.health.v1's List (added to the protocol in 2024), which grpcio's aio
    servicer leaves raising NotImplementedError: UNIMPLEMENTED for the client, a traceback in our log at
    every call."""

    async def List(self, request: health_pb2.HealthListRequest, context: object) -> health_pb2.HealthListResponse:
        response = health_pb2.HealthListResponse()
        for service, status in self._server_status.items():
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

    def add_to(self, server: GenericOnly) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if self.gauge is not None:
            self.gauge.set(int(serving))
        for service in self.services:
            await self.servicer.set(service, status)
        for service in self.never:
            await self.servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def shutdown(self) -> None:
        """NOT_SERVING for good: watchers get it, and no later set() changes it."""
        if self.gauge is not None:
            self.gauge.set(0)
        await self.servicer.enter_graceful_shutdown()
