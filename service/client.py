"""Small synchronous clients behind `mhaserve encode` and `mhaserve health`.

Both speak plaintext by default; `Connection` adds TLS (a CA to trust, and a client certificate for
mutual TLS) and an API key, sent as `authorization: Bearer <key>` metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.context import REQUEST_ID_HEADER
from mhaserve.service.tls import channel_credentials

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_PORT = DEFAULT_ADDRESS.rpartition(":")[2]
# Responses grow with inputs x dimensions; the client should never be the one to refuse them.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 * 1024 * 1024)]
# The longest timeout a client takes, about three years: grpcio fails every call whose deadline is much further
# (1e10 s: DEADLINE_EXCEEDED at once, as if the server were at fault), on either front.
MAX_TIMEOUT_S = 100_000_000


def is_target(address: str) -> bool:
    """Whether `address` is a target grpc reads itself (`dns:///...`, `unix:...`, a URL), not HOST:PORT."""
    return address.startswith(("dns:", "unix:", "ipv4:", "ipv6:")) or "://" in address


def with_default_port(address: str) -> str:
    """`address` (host, host:port, [v6] or [v6]:port) with the server's port where it names none: grpc's own
    default is 443, where nothing is listening. A target grpc reads itself (`dns:///...`, `unix:...`) is left."""
    if is_target(address):
        return address
    named = "]:" in address if address.startswith("[") else ":" in address
    return address if named else f"{address}:{DEFAULT_PORT}"


@dataclass(frozen=True)
class Connection:
    """How to reach a server: TLS when `tls` or any file is set, and an optional API key (never shown)."""

    tls: bool = False
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    api_key: str | None = field(default=None, repr=False)

    def channel(self, address: str, options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
        # A key alone too: refused as half a pair by channel_credentials, where it went unread over plaintext.
        if self.tls or self.ca is not None or self.cert is not None or self.key is not None:
            return grpc.secure_channel(address, channel_credentials(self.ca, self.cert, self.key), options=options)
        return grpc.insecure_channel(address, options=options)

    def metadata(self, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...] | None:
        items = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()
        return (*items, *extra) or None


PLAINTEXT = Connection()


def encode(
    address: str,
    texts: Sequence[str],
    *,
    model: str = "",
    normalize: bool | None = None,
    truncate: bool | None = None,
    dimensions: int | None = None,
    prompt_name: str = "",
    timeout: float = 30.0,
    request_id: str | None = None,
    connection: Connection = PLAINTEXT,
    channel: grpc.Channel | None = None,
) -> pb.EncodeResponse:
    """One Encode call; raises grpc.RpcError with the server's status.

    `channel` (from `connection.channel(address, CHANNEL_OPTIONS)`) lets several calls share one
    connection: a new one per call pays the TCP (and TLS) handshake each time.
    """
    request = pb.EncodeRequest(texts=list(texts), model=model, prompt_name=prompt_name)
    if truncate is not None:  # absent: the server's --auto-truncate
        request.truncate = truncate
    if normalize is not None:
        request.normalize = normalize
    if dimensions is not None:
        request.dimensions = dimensions
    metadata = connection.metadata(*(((REQUEST_ID_HEADER, request_id),) if request_id else ()))
    shared = contextlib.nullcontext(channel) if channel is not None else None
    with shared or connection.channel(address, CHANNEL_OPTIONS) as used:
        response: pb.EncodeResponse = pb_grpc.EncoderServiceStub(used).Encode(
            request, timeout=timeout, metadata=metadata
        )
        return response


def model_info(
    address: str,
    *,
    model: str = "",
    timeout: float = 30.0,
    connection: Connection = PLAINTEXT,
    channel: grpc.Channel | None = None,
) -> pb.GetModelInfoResponse:
    """One GetModelInfo call (`model` as Encode takes it: a name, name:version, or "" for the default); raises
    grpc.RpcError with the server's status."""
    shared = contextlib.nullcontext(channel) if channel is not None else None
    with shared or connection.channel(address, CHANNEL_OPTIONS) as used:
        response: pb.GetModelInfoResponse = pb_grpc.EncoderServiceStub(used).GetModelInfo(
            pb.GetModelInfoRequest(model=model), timeout=timeout, metadata=connection.metadata()
        )
        return response


def copy_of(info: pb.GetModelInfoResponse) -> tuple[str, int, str]:
    """What tells one loaded copy of a model version from another whose vectors may differ (the same version
    loaded again from changed files, or with other settings): GetModelInfo's digest of it."""
    return (info.name, info.version, info.digest)


def health(address: str, *, service: str = "", timeout: float = 5.0, connection: Connection = PLAINTEXT) -> str:
    """The serving status name (SERVING, NOT_SERVING, ...); raises grpc.RpcError if the server cannot answer."""
    with connection.channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=connection.metadata()
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def vectors(response: pb.EncodeResponse) -> npt.NDArray[np.float32]:
    """The embeddings of a response, (n, d) float32, whether it was packed or not."""
    if response.dimensions:
        return np.frombuffer(response.packed, dtype="<f4").reshape(-1, response.dimensions).astype(np.float32)
    if not response.embeddings:  # no width to read
        return np.empty((0, 0), dtype=np.float32)
    return np.array([e.values for e in response.embeddings], dtype=np.float32).reshape(len(response.embeddings), -1)


def embeddings_json(response: pb.EncodeResponse) -> str:
    """One JSON array per input, one per line, in input order: each value the shortest decimal that reads back as
    the server's float32 (json.dumps of the float would print its float64 digits, 17 of them, and rounding to a
    few decimals lost small values: 1e-33 printed -0.0)."""
    return "\n".join("[" + ", ".join(str(v) for v in row) + "]" for row in vectors(response))


def summary(texts: Sequence[str], response: pb.EncodeResponse) -> str:
    dims = len(response.embeddings[0].values) if response.embeddings else 0
    n = len(response.embeddings)
    lines = [
        f"{response.model} version {response.model_version}: {n} embedding{'' if n == 1 else 's'} of {dims} "
        f"dimensions, {response.usage.input_tokens} input tokens"
    ]
    for i, (text, e) in enumerate(zip(texts, response.embeddings, strict=True)):
        v = np.asarray(e.values, dtype=np.float32)
        head = ", ".join(f"{x:+.4f}" for x in v[:4])
        shown = text if len(text) <= 40 else text[:37] + "..."
        lines.append(f"[{i}] norm {np.linalg.norm(v):.4f} [{head}, ...] {shown!r}")
    return "\n".join(lines)
