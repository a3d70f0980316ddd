"""The drain as a balancer sees it: a real `mhaserve serve` process on loopback, SIGTERM, and every
socket a balancer would use, timed. No container, no balancer: what HAProxy's health checks and retries
(deploy/haproxy/haproxy.cfg) rely on, checked at the server.

tests/reliability/test_shutdown.py checks the server's side of the same sequence in process (the state
machine, calls held across the delay, streams); this checks it from outside, over fresh and kept-alive
connections: NOT_SERVING at once on both health endpoints and on a health watch, fresh connections of both
protocols still served for the whole delay, then nothing listening, idle keep-alive connections closed
(what a balancer retries as a connection failure or an empty response), exit 0.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from tests.deploy.helpers import WAIT, Replica, encode, health, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

DELAY = 3.0


def http_status(address: str, method: str, path: str, body: object = None) -> int:
    """One request on a fresh connection, as a balancer's health check or a new client makes it."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def refused(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed this idle connection (a read gives EOF or a reset)."""
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_sigterm_says_not_serving_at_once_serves_for_the_delay_then_refuses_at_the_connection(
    replicas: Callable[..., list[Replica]], tmp_path: Path
) -> None:
    (replica,) = replicas(1, http=True, drain_delay=str(DELAY))
    # A balancer's kept-alive connection to the HTTP port, idle when the drain begins.
    host, _, port = replica.http_address.rpartition(":")
    idle = socket.create_connection((host, int(port)), timeout=5)
    idle.sendall(f"GET /health HTTP/1.1\r\nHost: {replica.http_address}\r\n\r\n".encode())
    assert idle.recv(4096).startswith(b"HTTP/1.1 200"), "the kept-alive connection was not answered"
    # A health watcher (a gRPC-aware balancer, a mesh): it must be told, not have to ask.
    channel = grpc.insecure_channel(replica.address)
    watched: list[tuple[float, str]] = []

    def watch() -> None:
        try:
            for r in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=WAIT):
                watched.append((time.monotonic(), health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)))
        except grpc.RpcError:
            pass  # the stream ends with the server

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    wait_until(lambda: bool(watched) and watched[-1][1] == "SERVING", "the watch to say SERVING")
    try:
        signalled = time.monotonic()
        replica.signal(signal.SIGTERM)

        # At once: NOT_SERVING on both health endpoints and on the watch.
        wait_until(lambda: http_status(replica.http_address, "GET", "/health") == 503, "/health to say 503", 2, 0.05)
        assert health(replica.address) == "NOT_SERVING"
        wait_until(lambda: watched[-1][1] == "NOT_SERVING", "the watch to say NOT_SERVING", 2, 0.05)
        not_serving_after = max(watched[-1][0], time.monotonic()) - signalled
        assert not_serving_after < 1.5, f"NOT_SERVING only {not_serving_after:.1f} s after SIGTERM"

        # For the whole delay: fresh connections of both protocols are served, and so is the idle one.
        served = 0
        while time.monotonic() - signalled < DELAY - 0.7:
            with grpc.insecure_channel(replica.address) as fresh:
                assert len(encode(pb_grpc.EncoderServiceStub(fresh), "during the delay").embeddings) == 1
            status = http_status(replica.http_address, "POST", "/v1/embeddings", {"input": ["during the delay"]})
            assert status == 200, f"HTTP {status} {time.monotonic() - signalled:.1f} s into a {DELAY} s delay"
            served += 1
            time.sleep(0.1)
        assert served >= 3, "too few calls inside the delay: nothing was tested"
        assert not closed_by_peer(idle), "the idle keep-alive connection was closed inside the delay"

        # Then: nothing listens on either port, and the idle connection is closed by the server (a
        # balancer reusing it gets a connection failure, which it retries elsewhere).
        wait_until(lambda: refused(replica.address) and refused(replica.http_address), "the ports to close", WAIT)
        stopped_listening = time.monotonic() - signalled
        assert stopped_listening >= DELAY, f"stopped listening {stopped_listening:.1f} s after SIGTERM"
        wait_until(lambda: closed_by_peer(idle), "the idle keep-alive connection to be closed", 5, 0.1)

        code = replica.wait(WAIT)
        took = time.monotonic() - signalled
        assert code == 0, f"exit {code} after SIGTERM:\n{replica.log()}"
        # The helper's --grace-period is 10 s; nothing was in flight, so the drain itself is quick.
        assert took < DELAY + 10, f"exited {took:.1f} s after SIGTERM"
        print(
            f"\ndrain: NOT_SERVING {not_serving_after * 1000:.0f} ms after SIGTERM, {served} fresh gRPC + HTTP "
            f"calls served in the {DELAY:g} s delay, ports closed at {stopped_listening:.1f} s, exit 0 at {took:.1f} s"
        )
    finally:
        idle.close()
        channel.close()
        watcher.join(WAIT)
