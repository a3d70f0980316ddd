"""Plain clients under load, for the rolling-restart tests: what a user without any retry logic sees.

Each client is its own connection, as separate users would be: a gRPC channel with no retry policy and no
wait-for-ready (gRPC's own transparent retry of a stream that never reached a server is all it gets), or an
`http.client` keep-alive connection to the OpenAI route (it opens a new connection after a `Connection:
close`, as HTTP says, but never resends: a connection closed under a request is a failed call). Every
client stops after `max_calls` calls, or when `stop()` is called; every wait has a deadline.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as epb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as epb_grpc
from mhaserve.testing.loopback import WAIT, wait_until

Protocol = Literal["grpc", "http"]


def grpc_caller(address: str) -> tuple[Callable[[str], None], Callable[[], None]]:
    """Encode over one channel with no retry policy: (call, close)."""
    channel = grpc.insecure_channel(address)
    stub = epb_grpc.EncoderServiceStub(channel)

    def call(text: str) -> None:
        try:
            stub.Encode(epb.EncodeRequest(texts=[text]), timeout=WAIT)
        except grpc.RpcError as e:
            raise CallFailed(f"{e.code().name}: {(e.details() or '')[:80]}") from None

    return call, channel.close


def http_caller(address: str) -> tuple[Callable[[str], None], Callable[[], None]]:
    """POST /v1/embeddings over one keep-alive connection, opened again only after a failure: (call, close)."""
    host, _, port = address.rpartition(":")
    conn = [http.client.HTTPConnection(host, int(port), timeout=WAIT)]

    def call(text: str) -> None:
        body = json.dumps({"input": [text]})
        try:
            conn[0].request("POST", "/v1/embeddings", body=body, headers={"Content-Type": "application/json"})
            response = conn[0].getresponse()
            content = response.read()
        except (OSError, http.client.HTTPException) as e:
            conn[0].close()
            conn[0] = http.client.HTTPConnection(host, int(port), timeout=WAIT)
            raise CallFailed(f"{type(e).__name__}: {e}") from None
        if response.status != 200:
            raise CallFailed(f"HTTP {response.status}: {content[:80]!r}")

    return call, lambda: conn[0].close()


CALLERS = {"grpc": grpc_caller, "http": http_caller}


class CallFailed(Exception):
    """A call that got no answer or an error: its status and message."""


class Load:
    """`clients` plain clients calling `address` back to back (each waits for its answer), in threads."""

    def __init__(self, protocol: Protocol, address: str, clients: int = 16, max_calls: int = 5000) -> None:
        self.protocol = protocol
        self.ok: list[float] = []  # when each answer came
        self.errors: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(address, k, max_calls), daemon=True) for k in range(clients)
        ]
        for t in self._threads:
            t.start()

    def _client(self, address: str, k: int, max_calls: int) -> None:
        call, close = CALLERS[self.protocol](address)
        try:
            for i in range(max_calls):
                if self._done.is_set():
                    return
                try:
                    call(f"client {k} call {i}: a short text to embed")
                except CallFailed as e:
                    with self._lock:
                        self.errors[str(e)] += 1
                    continue
                with self._lock:
                    self.ok.append(time.monotonic())
        finally:
            close()

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def answered_since(self, moment: float) -> int:
        with self._lock:
            return sum(t > moment for t in self.ok)

    def wait_for_answers(self, n: int, since: float, what: str, timeout: float) -> None:
        """Until n more calls were answered after `since` (fails if the clients ran out of calls first)."""
        wait_until(lambda: self.answered_since(since) >= n or not self.running, what, timeout, 0.1)
        assert self.answered_since(since) >= n, f"the clients stopped ({self.protocol}) before {what}"

    def stop(self) -> None:
        self._done.set()
        for t in self._threads:
            t.join(WAIT)

    def summary(self) -> str:
        return f"{len(self.ok)} answered, {sum(self.errors.values())} failed {dict(self.errors)}"
