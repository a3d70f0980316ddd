"""The lean gRPC front (`--grpc-front lean`): HTTP/2 and gRPC's framing on an asyncio Protocol, in the
event loop's own thread, in place of grpc.aio's server.

grpc.aio runs each call through grpc core's C threads and hands every completion of it (four a unary call)
from its poller thread to the event loop; at 32 clients that is most of the loop's own CPU a request
(docs/benchmarks.md). This front reads and writes the socket from the loop itself and serves the same
generic handlers through the same interceptors, so every service, error map and metric is the one the
default front serves. What it does not do is in docs/grpc-fronts.md.

- frames.py: HTTP/2 frames and the header blocks this front writes, none of which touches HPACK's table;
- connection.py: one client connection: frames in, streams, flow control both ways, frames out;
- calls.py: one call: the interceptors and the handler, its context, its status;
- server.py: the listening socket, the connections' timers, and stopping with a grace period.
"""
