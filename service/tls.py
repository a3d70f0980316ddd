"""TLS for the gRPC port: server credentials from PEM files, mutual TLS with a client CA, and the client side.

Plaintext stays the default, for loopback development; a server listening in plaintext on any other
address says so in its log, once, at start-up.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsError(ValueError):
    """A certificate or key that cannot be read; the message names the file and the flag."""


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TlsError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{what} {path} is not PEM (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True)
class TlsFiles:
    """The server's PEM files: its certificate chain and key, and the CA that signs client certificates
    (mutual TLS). No certificate: plaintext."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None

    @property
    def mode(self) -> str:
        """How the port is served, for the log: plaintext, TLS or mutual TLS."""
        if self.cert is None:
            return "plaintext"
        return "mutual TLS" if self.client_ca is not None else "TLS"


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of TlsFiles, read and checked once at start-up (every port uses the same)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None

    @classmethod
    def read(cls, files: TlsFiles) -> TlsMaterial | None:
        if files.cert is None or files.key is None:
            return None
        material = cls(
            cert=_read(files.cert, "--tls-cert"),
            key=_read(files.key, "--tls-key"),
            client_ca=_read(files.client_ca, "--tls-client-ca") if files.client_ca is not None else None,
        )
        _check_pair(files.cert, files.key)
        if files.client_ca is not None:
            _check_ca(files.client_ca, "--tls-client-ca")
        return material


def _check_pair(cert: Path, key: Path) -> None:
    """The certificate and key as OpenSSL reads them, before the ports do: gRPC core's own failure names
    neither file (it reads as a port that cannot be bound), uvicorn's a stack trace."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(cert))
    except ssl.SSLError:
        raise TlsError(f"--tls-cert {cert} holds no PEM certificate") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback that gives none: an encrypted key is an error here, not a prompt on the terminal.
        context.load_cert_chain(str(cert), str(key), password=lambda: b"")
    except ssl.SSLError as e:
        reason = e.reason or str(e)
        if reason == "KEY_VALUES_MISMATCH":
            raise TlsError(f"--tls-key {key} is not the key of the certificate --tls-cert {cert}") from None
        raise TlsError(f"--tls-key {key} is not an unencrypted PEM private key (OpenSSL: {reason})") from None


def _check_ca(path: Path, what: str) -> None:
    """A CA file that holds a certificate OpenSSL can load (a private key in its place is PEM too)."""
    try:
        ssl.create_default_context(cafile=str(path))
    except ssl.SSLError as e:
        raise TlsError(f"{what} {path} holds no usable certificate ({e.reason})") from None


def server_credentials(material: TlsMaterial | None) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port, or None for plaintext. With a client CA, clients must present a
    certificate that CA signed (the handshake fails otherwise, before any RPC)."""
    if material is None:
        return None
    return grpc.ssl_server_credentials(
        [(material.key, material.cert)],
        root_certificates=material.client_ca,
        require_client_auth=material.client_ca is not None,
    )


def server_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """The gRPC port's TLS for the lean front (HTTP/2 by ALPN), from the same files as grpc's credentials."""
    assert files.cert is not None and files.key is not None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(files.cert), str(files.key))
    if files.client_ca is not None:
        context.load_verify_locations(cafile=str(files.client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["h2"])
    return context


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def channel_credentials(
    ca: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """Client-side TLS: trust `ca` (default: the system's roots); present `cert`/`key` for mutual TLS. The files
    are checked as the server checks its own: grpc took any PEM, and a key that is not the certificate's or a CA
    file with no certificate failed each call as "UNAVAILABLE: ... Failed to create security handshaker"."""
    if (cert is None) != (key is None):
        raise TlsError("--tls-cert and --tls-key go together (the client certificate and its key)")
    root_certificates = private_key = certificate_chain = None
    if ca is not None:
        root_certificates = _read(ca, "--tls-ca")
        _check_ca(ca, "--tls-ca")
    if cert is not None and key is not None:
        certificate_chain, private_key = _read(cert, "--tls-cert"), _read(key, "--tls-key")
        _check_pair(cert, key)
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
