"""grpc.health.v1 for the whole server and each gRPC service it serves, set together.

Orchestrators ask for the server ("") or for one service by name; both must say the same thing, so the
status is only ever set here, for all of them at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from mhaserve.service.rpc.registration import GenericOnly

SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class Health:
    """The health servicer, and the one way to change what it reports."""

    def __init__(self, services: Sequence[str]) -> None:
        self.servicer = health_aio.HealthServicer()
        self.services = ("", *services)

    def add_to(self, server: GenericOnly) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in self.services:
            await self.servicer.set(service, status)

    async def shutdown(self) -> None:
        """NOT_SERVING for good: watchers get it, and no later set() changes it."""
        await self.servicer.enter_graceful_shutdown()
