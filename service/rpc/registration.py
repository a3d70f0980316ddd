"""Services go onto the gRPC server as generic handlers only, never as registered methods.

Stubs made by grpcio-tools 1.62 and later add each service twice: as a generic handler, and method by
method as registered methods (`add_registered_method_handlers`). grpc.aio's server then keeps one
pending accept per registered method and one for everything else, and after every call it waits on all
of them again (`asyncio.wait` in `AioServer._server_main_loop`, grpcio 1.85). With the 20 methods of
encoder.v1, the Open Inference Protocol, health and reflection, every call built a set of 21 futures and
added and removed 21 done-callbacks on the event loop: about 19 us of CPU and 0.06 ms of latency a call
on a 2-core EPYC (docs/benchmarks.md, "Registered gRPC methods"). A registered method buys grpc.aio
nothing in exchange: it reads no message ahead (it passes no payload buffer), and the generic handler
the same stubs add serves every method by a dict lookup. So the server gets the generic handlers, and
`GenericOnly` drops the registrations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import grpc
import grpc.aio


class GenericOnly:
    """What the generated `add_*Servicer_to_server` functions need of a server, adding generic handlers only."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(handlers))

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, Any]) -> None:
        """Dropped: the generic handler added beside it serves the same methods (see the module docstring)."""
