"""TLS for the gRPC port: server credentials from PEM files, mutual TLS with a client CA, and the client side.

Plaintext stays the default, for loopback development; a server listening in plaintext on any other
address says so in its log, once, at start-up.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Iterator, Sequence
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
    """The PEM bytes of TlsFiles, read and checked once at start-up: every port serves these (server_credentials,
    server_ssl_context), and with --processes N every process, one started again too, not the files as they
    are by then."""

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
        _check_pair(material.cert, material.key, files.cert, files.key)
        if material.client_ca is not None and files.client_ca is not None:
            _check_ca(material.client_ca, files.client_ca, "--tls-client-ca")
        return material


def _check_pair(cert: bytes, key: bytes, cert_path: Path, key_path: Path) -> None:
    """A certificate and its key as read, checked as OpenSSL reads them before a port (or a client's channel)
    does: gRPC core's own failure names neither file (a port that cannot be bound; a client's "Failed to create
    security handshaker" on each call), uvicorn's a stack trace."""
    with _in_memory(cert) as cert_file, _in_memory(key) as key_file:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert_file)
        except ssl.SSLError:
            raise TlsError(f"--tls-cert {cert_path} holds no PEM certificate") from None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            # A password callback that gives none: an encrypted key is an error here, not a prompt on the terminal.
            context.load_cert_chain(cert_file, key_file, password=lambda: b"")
        except ssl.SSLError as e:
            reason = e.reason or str(e)
            if reason == "KEY_VALUES_MISMATCH":
                why = f"is not the key of the certificate --tls-cert {cert_path}"
            else:
                why = f"is not an unencrypted PEM private key (OpenSSL: {reason})"
            raise TlsError(f"--tls-key {key_path} {why}") from None


def _check_ca(ca: bytes, path: Path, what: str) -> None:
    """A CA file as read, holding a certificate OpenSSL can load (a private key in its place is PEM too)."""
    with _in_memory(ca) as ca_file:
        try:
            ssl.create_default_context(cafile=ca_file)
        except ssl.SSLError as e:
            raise TlsError(f"{what} {path} holds no usable certificate ({e.reason})") from None


@contextlib.contextmanager
def _in_memory(data: bytes) -> Iterator[str]:
    """A path OpenSSL reads `data` from (Python's ssl loads a certificate chain and its key from files alone): on
    Linux a file in memory, never on a disk, gone once closed; where there is none, a temporary file only this user
    can read, removed once read."""
    fd = _memfd(data)
    if fd is None:
        with tempfile.NamedTemporaryFile() as file:
            file.write(data)
            file.flush()
            yield file.name
        return
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _memfd(data: bytes) -> int | None:
    """A file in memory holding `data`, read at /proc/self/fd/N; None where there is none: not Linux, or a kernel or
    a seccomp profile that refuses memfd_create (the server died of that OSError), or no /proc."""
    try:
        fd = os.memfd_create("mhaserve-tls", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        return None
    try:
        with open(fd, "wb", closefd=False) as file:
            file.write(data)
        os.stat(f"/proc/self/fd/{fd}")
    except OSError:
        os.close(fd)
        return None
    return fd


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


def server_ssl_context(material: TlsMaterial, alpn: Sequence[str] = ()) -> ssl.SSLContext:
    """A port's TLS in Python's ssl, from the same material as grpc's credentials: the lean gRPC front's (HTTP/2
    by ALPN, `alpn` ["h2"]) and the HTTP port's."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with _in_memory(material.cert) as cert, _in_memory(material.key) as key:
        context.load_cert_chain(cert, key)
    if material.client_ca is not None:
        with _in_memory(material.client_ca) as ca:
            context.load_verify_locations(cafile=ca)
        context.verify_mode = ssl.CERT_REQUIRED
    if alpn:
        context.set_alpn_protocols(list(alpn))
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
        _check_ca(root_certificates, ca, "--tls-ca")
    if cert is not None and key is not None:
        certificate_chain, private_key = _read(cert, "--tls-cert"), _read(key, "--tls-key")
        _check_pair(certificate_chain, private_key, cert, key)
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
