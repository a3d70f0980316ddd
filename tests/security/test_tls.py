"""TLS and mutual TLS on the gRPC port, with certificates made for the test; plaintext stays the default."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import logging
import re
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2

from mhaserve.cli.main import main
from mhaserve.cli.options import build
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service import connections, tls
from mhaserve.service.auth import KeyRing, Keys
from mhaserve.service.client import Connection
from mhaserve.service.server import EncoderServer, StartupError
from mhaserve.service.settings import ApiKeys, Settings, SettingsError
from mhaserve.testing.http import request
from mhaserve.testing.loopback import WAIT, free_port, wait_until
from mhaserve.testing.metrics import scrape
from mhaserve.testing.process import ServerProcess
from mhaserve.testing.server import ServerThread, health_status
from tests.security.conftest import Pki
from tests.service.rust_h2_client import CHECK, ENCODE, call, h2_client, h2_client_fails, needs_client, only

TEXT = pb.EncodeRequest(texts=["over TLS"])


def encode(address: str, connection: Connection, timeout: float = WAIT) -> grpc.StatusCode:
    with connection.channel(address) as channel:
        try:
            pb_grpc.EncoderServiceStub(channel).Encode(TEXT, timeout=timeout, metadata=connection.metadata())
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def plain(tiny_repo: Path, grpc_front: str) -> Settings:
    return Settings(
        repository=tiny_repo,
        model=("tiny",),
        port=0,
        metrics_port=0,
        http_port=0,
        device="cpu",
        intra_op_threads=1,
        grpc_front=grpc_front,
    )


@pytest.fixture(scope="module")
def tls_server(plain: Settings, pki: Pki) -> Iterator[ServerThread]:
    settings = dataclasses.replace(plain, tls_cert=pki.server_cert, tls_key=pki.server_key, http_port=free_port())
    with ServerThread(settings) as srv:
        yield srv.ready()


@pytest.fixture(scope="module")
def mtls_server(plain: Settings, pki: Pki) -> Iterator[ServerThread]:
    settings = dataclasses.replace(
        plain,
        tls_cert=pki.server_cert,
        tls_key=pki.server_key,
        tls_client_ca=pki.ca,
        api_keys=ApiKeys(("k-1",)),
        http_port=free_port(),
    )
    with ServerThread(settings) as srv:
        yield srv.ready()


def test_tls_serves_clients_that_trust_its_ca_only(tls_server: ServerThread, pki: Pki) -> None:
    address = tls_server.address
    assert encode(address, Connection(ca=pki.ca)) == grpc.StatusCode.OK
    assert encode(f"localhost:{tls_server.server.port}", Connection(ca=pki.ca)) == grpc.StatusCode.OK
    with Connection(ca=pki.ca).channel(address) as channel:
        assert health_status(channel) == "SERVING"
    # A client that does not trust the CA, and a plaintext client, never get an answer.
    assert encode(address, Connection(ca=pki.other_ca), timeout=5) == grpc.StatusCode.UNAVAILABLE
    assert encode(address, Connection(), timeout=5) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_wants_a_client_certificate_from_its_ca(mtls_server: ServerThread, pki: Pki) -> None:
    address = mtls_server.address
    good = Connection(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, api_key="k-1")
    assert encode(address, good) == grpc.StatusCode.OK
    # The key is still asked for: mutual TLS and API keys combine.
    assert encode(address, dataclasses.replace(good, api_key=None)) == grpc.StatusCode.UNAUTHENTICATED
    for refused in (
        Connection(ca=pki.ca, api_key="k-1"),  # no certificate
        Connection(ca=pki.ca, cert=pki.stranger_cert, key=pki.stranger_key, api_key="k-1"),  # another CA's
        Connection(ca=pki.ca, cert=pki.server_cert, key=pki.server_key, api_key="k-1"),  # not for clients
    ):
        assert encode(address, refused, timeout=5) == grpc.StatusCode.UNAVAILABLE


@needs_client
def test_tonics_tls_rustls_chooses_h2_by_alpn_and_is_served(tls_server: ServerThread, pki: Pki) -> None:
    """tonic's TLS is rustls: it checks the server's name (only a subjectAltName counts), offers h2 alone by ALPN,
    and tonic refuses a connection on which the server did not choose it (tests/service/rust_h2)."""
    calls = [call(ENCODE, TEXT.SerializeToString()), call(CHECK, health_pb2.HealthCheckRequest().SerializeToString())]
    got = h2_client(tls_server.address, calls, tls={"ca": str(pki.ca), "server_name": "localhost"})
    assert got["alpn"] == "h2"
    [[[encoded], [health]]] = got["rounds"]
    assert len(pb.EncodeResponse.FromString(only(encoded)).embeddings) == 1
    assert health_pb2.HealthCheckResponse.FromString(only(health)).status == health_pb2.HealthCheckResponse.SERVING
    assert "UnknownIssuer" in h2_client_fails(tls_server.address, calls, tls={"ca": str(pki.other_ca)})


@needs_client
def test_tonics_mutual_tls_with_rustls_wants_a_client_certificate_from_the_ca(
    mtls_server: ServerThread, pki: Pki
) -> None:
    calls = [call(ENCODE, TEXT.SerializeToString(), metadata=(("authorization", "Bearer k-1"),))]
    good = {"ca": str(pki.ca), "cert": str(pki.client_cert), "key": str(pki.client_key)}
    [[[encoded]]] = h2_client(mtls_server.address, calls, tls=good)["rounds"]
    assert len(pb.EncodeResponse.FromString(only(encoded)).embeddings) == 1
    for refused in (
        {"ca": str(pki.ca)},  # no certificate
        {**good, "cert": str(pki.stranger_cert), "key": str(pki.stranger_key)},  # another CA's
    ):
        # The server ends the connection after the handshake (rustls reads its end, or a reset), on either front.
        assert "Io(Kind(" in h2_client_fails(mtls_server.address, calls, tls=refused)


def https(server: ServerThread) -> str:
    return f"https://127.0.0.1:{server.server.http_port}/v1/embeddings"


def context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def test_the_http_port_speaks_the_same_tls(tls_server: ServerThread, pki: Pki) -> None:
    reply = request("POST", https(tls_server), {"input": "hello"}, context=context(pki.ca))
    assert reply.status == 200 and len(reply.json()["data"]) == 1
    with pytest.raises(ssl.SSLError):
        request("POST", https(tls_server), {"input": "hello"}, context=context(pki.other_ca))


def test_a_client_speaking_plaintext_to_a_tls_port_is_told_so(tls_server: ServerThread, pki: Pki) -> None:
    """The bug: a client that forgot TLS read only "Remote end closed connection without response" (HTTP) or
    "Socket closed" (gRPC), as the handshake failed on its first bytes. HTTP now gets a 400 saying so, in its
    route's shape (as Go's servers and nginx answer), and on the lean front a gRPC client's calls UNAVAILABLE
    and a plain HTTP request to the gRPC port a 400 (it read "Empty reply from server")."""
    plain = f"http://127.0.0.1:{tls_server.server.http_port}"
    with (
        openai.OpenAI(base_url=plain + "/v1", api_key="unused", max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as e,
    ):
        client.embeddings.create(input=["hello"], model="tiny")
    assert "this port speaks HTTPS" in e.value.message and "https://" in e.value.message
    kserve = request("GET", plain + "/v2/health/ready")  # KServe's routes: their own body's shape
    assert kserve.status == 400 and "this port speaks HTTPS" in json.loads(kserve.body)["error"]
    with grpc.insecure_channel(tls_server.address) as channel:
        with pytest.raises(grpc.RpcError) as g:
            pb_grpc.EncoderServiceStub(channel).Encode(TEXT, timeout=10)
        assert g.value.code() == grpc.StatusCode.UNAVAILABLE
        if tls_server.server.settings.grpc_front == "lean":  # grpc.aio's front: grpc core's handshake, unchanged
            assert "this port speaks TLS" in g.value.details() and "--tls-ca" in g.value.details()
            with pytest.raises(grpc.RpcError) as h:  # a health probe's call reads the same
                health_status(channel, timeout=10)
            assert "this port speaks TLS" in h.value.details()
            # and a plain HTTP/1.1 request to the gRPC port (curl http://) reads what the port speaks
            misplaced = request("GET", f"http://{tls_server.address}/v1/models")
            assert misplaced.status == 400 and b"this port speaks gRPC over TLS" in misplaced.body
            assert b"--http-port" in misplaced.body
    # and the clients that speak TLS are served as ever
    assert request("POST", https(tls_server), {"input": "hello"}, context=context(pki.ca)).status == 200
    assert encode(tls_server.address, Connection(ca=pki.ca)) == grpc.StatusCode.OK


def test_the_http_port_speaks_the_same_mutual_tls(mtls_server: ServerThread, pki: Pki) -> None:
    key = {"authorization": "Bearer k-1"}
    good = context(pki.ca, pki.client_cert, pki.client_key)
    assert request("POST", https(mtls_server), {"input": "hello"}, key, context=good).status == 200
    assert request("POST", https(mtls_server), {"input": "hello"}, context=good).status == 401  # keys still apply
    for refused in (context(pki.ca), context(pki.ca, pki.stranger_cert, pki.stranger_key)):
        with pytest.raises((ssl.SSLError, OSError)):
            request("POST", https(mtls_server), {"input": "hello"}, key, context=refused)


def test_a_silent_connection_to_either_tls_port_is_closed_after_the_header_timeout(plain: Settings, pki: Pki) -> None:
    """With TLS the HTTP port's header deadline starts after the handshake: a connection that never sent its
    ClientHello was held for asyncio's 60 s (gRPC's: 120 s), not --http-header-timeout."""
    settings = dataclasses.replace(
        plain, tls_cert=pki.server_cert, tls_key=pki.server_key, http_port=free_port(), http_header_timeout=0.5
    )
    with ServerThread(settings) as srv:
        srv.ready()
        for port in (srv.server.http_port, int(srv.address.rsplit(":", 1)[1])):
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
                started = time.monotonic()
                with contextlib.suppress(ConnectionResetError):
                    assert s.recv(1) == b""
                assert time.monotonic() - started < WAIT / 2, port


def test_connections_in_their_tls_handshake_count_against_the_limit(plain: Settings, pki: Pki) -> None:
    """The bug: asyncio tells a protocol of a TLS connection only once its handshake is done, and never of one that
    failed, so connections that sent no ClientHello held a descriptor each outside --max-connections until the
    handshake timed out. Now a connection is counted from its accept, and let go when its handshake fails, times
    out or is cut; silent in its handshake, it gives way to a new connection, and where none is silent a client
    past the limit gets the refusal its protocol reads, counted once."""
    settings = dataclasses.replace(
        plain,
        tls_cert=pki.server_cert,
        tls_key=pki.server_key,
        http_port=free_port(),
        metrics_port=free_port(),
        http_header_timeout=2.0,  # the handshake's timeout too
        max_connections=2,
    )
    with ServerThread(settings) as srv:
        srv.ready()
        assert srv.server.metrics_port is not None and srv.server.http_port is not None
        metrics, http_port = srv.server.metrics_port, srv.server.http_port
        lean = plain.grpc_front == "lean"  # grpc.aio's front is counted by grpc core (service/connections.py)
        ports = [http_port, srv.server.port] if lean else [http_port, http_port]

        def count(name: str = "mhaserve_connections", **labels: str) -> float:
            return scrape(metrics).get(name, 0.0, **labels)

        silent = [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for port in ports]
        try:
            wait_until(lambda: count() == 2, "the silent connections to be counted")
            # the oldest, still in its handshake, is cut for the new one, whose place it takes
            assert request("POST", https(srv), {"input": "hello"}, context=context(pki.ca)).status == 200
            with contextlib.suppress(ConnectionResetError):
                assert silent[0].recv(1) == b""
            assert count("mhaserve_connections_closed_silent_total", protocol="http") == 1
        finally:
            for s in silent:
                s.close()  # cut during the handshake: their places are given back
        wait_until(lambda: count() == 0, "the cut handshakes to be let go")
        busy = [
            http.client.HTTPSConnection("127.0.0.1", http_port, timeout=WAIT, context=context(pki.ca)) for _ in ports
        ]
        try:
            for conn in busy:  # each has carried a request: not silent, never cut for a new one
                conn.request("GET", "/health")
                assert conn.getresponse().read() is not None
            refused = request("POST", https(srv), {"input": "hello"}, context=context(pki.ca))
            assert refused.status == 503 and b"--max-connections" in refused.body
            assert count("mhaserve_connections_refused_total", protocol="http") == 1  # once, not at each stage
            if lean:
                assert encode(srv.address, Connection(ca=pki.ca), timeout=10) == grpc.StatusCode.UNAVAILABLE
        finally:
            for conn in busy:
                conn.close()
        wait_until(lambda: count() == 0, "the busy connections to be let go")
        assert request("POST", https(srv), {"input": "hello"}, context=context(pki.ca)).status == 200
        assert encode(srv.address, Connection(ca=pki.ca)) == grpc.StatusCode.OK

        # A handshake that fails (bytes of no protocol), and one that times out, are let go too; and a request
        # in plain HTTP, answered 400, once its client closes.
        for port in ports:
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as failing:
                failing.sendall(b"\x00" * 64)
                with contextlib.suppress(ConnectionResetError):
                    assert failing.recv(1024) == b""
                wait_until(lambda: count() == 0, "the failed handshake to be let go")
        with socket.create_connection(("127.0.0.1", http_port), timeout=WAIT) as plaintext:
            plaintext.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            assert plaintext.recv(1024).startswith(b"HTTP/1.1 400 ")
            assert count() == 1
        wait_until(lambda: count() == 0, "the plaintext connection to be let go")
        with socket.create_connection(("127.0.0.1", ports[-1]), timeout=WAIT) as slow:
            wait_until(lambda: count() == 1, "the silent connection to be counted")
            with contextlib.suppress(ConnectionResetError):
                assert slow.recv(1) == b""  # closed at the handshake's timeout
            wait_until(lambda: count() == 0, "the timed-out handshake to be let go")


@pytest.mark.slow
def test_a_burst_of_silent_tls_connections_leaves_the_server_its_descriptors(
    tmp_path: Path, tiny_repo: Path, pki: Pki
) -> None:
    """The same bug at scale: a server allowed 320 open files, sent 640 connections that never begin their
    handshake (to its TLS ports, half each), ran out of descriptors (asyncio's accept failing with EMFILE) while
    they waited for their handshake timeout. Now the default limit (the files less the reserve) holds them, and
    a new client takes the place of the oldest of them."""
    files = connections.RESERVE + 64
    http_port = free_port()
    flags = ["--repository", str(tiny_repo), "--port", "0", "--http-port", str(http_port), "--metrics-port", "0"]
    flags += ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--http-header-timeout", "60"]
    with ServerProcess(flags, tmp_path / "server.log", files=files) as server:
        address = server.address()
        with Connection(ca=pki.ca).channel(address) as channel:
            wait_until(lambda: health_status(channel, timeout=2.0) == "SERVING", "the server to serve", 180)
        burst = []
        try:
            for port in (int(address.rsplit(":", 1)[1]), http_port):
                for _ in range(files):
                    burst.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT))
            time.sleep(1.0)  # for the server to accept what it will
            # Past the limit, held by silent connections: served in the place of the oldest, at once; not left in
            # the listen queue until its timeout
            url = f"https://127.0.0.1:{http_port}/v1/embeddings"
            assert request("POST", url, {"input": "hi"}, timeout=10.0, context=context(pki.ca)).status == 200
        finally:
            for s in burst:
                s.close()
        wait_until(lambda: encode(address, Connection(ca=pki.ca), timeout=5.0) == grpc.StatusCode.OK, "an answer")
        log = server.log
        assert "Too many open files" not in log and "out of system resource" not in log, log[-3000:]


def test_the_cli_speaks_tls_and_mutual_tls(
    tls_server: ServerThread, mtls_server: ServerThread, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["encode", "hello", "--summary", "--address", tls_server.address, "--tls-ca", str(pki.ca)]) == 0
    assert main(["health", "--address", tls_server.address, "--tls-ca", str(pki.ca)]) == 0
    mtls = ["--address", mtls_server.address, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert)]
    mtls += ["--tls-key", str(pki.client_key)]
    assert main(["encode", "hello", "--summary", "--api-key", "k-1", *mtls]) == 0
    assert main(["health", *mtls]) == 0
    capsys.readouterr()
    assert main(["health", "--address", mtls_server.address, "--tls-ca", str(pki.ca), "--timeout", "3"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert main(["health", "--address", tls_server.address, "--tls-cert", str(pki.client_cert)]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    # A key alone was not read at all, and the call went out in plaintext.
    assert main(["health", "--address", tls_server.address, "--tls-key", str(pki.client_key)]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["health"], ["encode", "hello"]])
def test_the_cli_checks_its_tls_files_as_the_server_checks_its_own(
    command: list[str], pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    """A certificate and key that are not a pair, or a CA file with no certificate, reached grpc: "UNAVAILABLE:
    Failed to create security handshaker" (exit 1), no file named. The server refuses the same files by name."""
    address = ["--address", f"127.0.0.1:{free_port()}", "--timeout", "3"]
    pair = ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    for files, message in (
        (
            ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.server_key)],
            f"--tls-key {pki.server_key} is not the key of the certificate --tls-cert {pki.client_cert}",
        ),
        (
            ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_key), "--tls-key", str(pki.client_key)],
            f"--tls-cert {pki.client_key} holds no PEM certificate",
        ),
        (
            ["--tls-ca", str(pki.server_key), *pair],
            f"--tls-ca {pki.server_key} holds no usable certificate (NO_CERTIFICATE_OR_CRL_FOUND)",
        ),
    ):
        assert main([*command, *address, *files]) == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", f"mhaserve {command[0]}: error: {message}\n")


def test_the_tls_material_is_served_where_files_in_memory_are_refused(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenSSL reads the certificate and key read at start-up from a file in memory (memfd); where the kernel or a
    seccomp profile refuses memfd_create, the server died with a bare OSError (a review's finding). It takes a
    private temporary file instead."""

    def memfd_refused(*_: object) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(tls.os, "memfd_create", memfd_refused, raising=False)
    material = tls.TlsMaterial.read(tls.TlsFiles(pki.server_cert, pki.server_key, pki.ca))
    assert material is not None and material.client_ca is not None
    context = tls.server_ssl_context(material)
    assert context.verify_mode == ssl.CERT_REQUIRED
    tls.channel_credentials(pki.ca, pki.client_cert, pki.client_key)  # the client's checks read them so too


def test_start_up_refuses_unusable_certificates(plain: Settings, pki: Pki, tmp_path: Path) -> None:
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82garbage")
    encrypted = tmp_path / "encrypted.key"  # with a passphrase: no prompt on the terminal, an error
    subprocess.run(
        ["openssl", "pkey", "-in", str(pki.server_key), "-aes256", "-passout", "pass:secret", "-out", str(encrypted)],
        check=True,
        capture_output=True,
    )
    for settings, message in (
        (dataclasses.replace(plain, tls_cert=tmp_path / "nope.pem", tls_key=pki.server_key), "cannot read --tls-cert"),
        (dataclasses.replace(plain, tls_cert=not_pem, tls_key=pki.server_key), "is not PEM"),
        # Each named by the flag at fault: gRPC core's own failure read as a port that cannot be bound.
        (
            dataclasses.replace(plain, tls_cert=pki.server_cert, tls_key=pki.client_key),
            f"--tls-key {pki.client_key} is not the key of the certificate --tls-cert {pki.server_cert}",
        ),
        (dataclasses.replace(plain, tls_cert=pki.server_key, tls_key=pki.server_key), "holds no PEM certificate"),
        (
            dataclasses.replace(plain, tls_cert=pki.server_cert, tls_key=pki.server_cert),
            "is not an unencrypted PEM private key",
        ),
        (dataclasses.replace(plain, tls_cert=pki.server_cert, tls_key=encrypted), "is not an unencrypted PEM private"),
    ):
        with pytest.raises(StartupError, match=message):
            ServerThread(settings)


def test_unusable_certificates_are_usage_errors_named_as_set(pki: Pki, tmp_path: Path) -> None:
    """A certificate or key set through a variable, found unusable, was "cannot start: --tls-key ... is not the
    key of the certificate --tls-cert ..." (exit 1) once the server started: flags never typed. build() reads
    them first now, a usage error naming each as it was set."""
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82garbage")
    for env, message in (
        ({"MHASERVE_TLS_CERT": not_pem, "MHASERVE_TLS_KEY": pki.server_key}, f"MHASERVE_TLS_CERT {not_pem} is not PEM"),
        (
            {"MHASERVE_TLS_CERT": pki.server_cert, "MHASERVE_TLS_KEY": pki.client_key},
            f"MHASERVE_TLS_KEY {pki.client_key} is not the key of the certificate MHASERVE_TLS_CERT {pki.server_cert}",
        ),
        (
            {
                "MHASERVE_TLS_CERT": pki.server_cert,
                "MHASERVE_TLS_KEY": pki.server_key,
                "MHASERVE_TLS_CLIENT_CA": not_pem,
            },
            f"MHASERVE_TLS_CLIENT_CA {not_pem} is not PEM",
        ),
    ):
        with pytest.raises(SettingsError, match=f"^{re.escape(message)}"):
            build({}, env={k: str(v) for k, v in env.items()})
    flags = {"tls_cert": pki.server_cert, "tls_key": pki.client_key}
    with pytest.raises(SettingsError, match=f"^--tls-key {re.escape(str(pki.client_key))} is not the key"):
        build(flags, env={})
    assert build({"tls_cert": pki.server_cert, "tls_key": pki.server_key}, env={}).tls_key == pki.server_key


def test_tls_settings_go_together(pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name, pem in (("s.pem", pki.server_cert), ("s.key", pki.server_key), ("ca.pem", pki.ca)):
        shutil.copy(pem, tmp_path / name)  # files the server can use (build() reads them)
    with pytest.raises(SettingsError, match="MHASERVE_TLS_CERT and --tls-key go together"):
        build({}, env={"MHASERVE_TLS_CERT": "server.pem"})
    with pytest.raises(SettingsError, match="MHASERVE_TLS_CLIENT_CA .* needs --tls-cert"):
        build({}, env={"MHASERVE_TLS_CLIENT_CA": "ca.pem"})
    s = build({}, env={"MHASERVE_TLS_CERT": "s.pem", "MHASERVE_TLS_KEY": "s.key", "MHASERVE_TLS_CLIENT_CA": "ca.pem"})
    assert (s.tls_cert, s.tls_key, s.tls_client_ca) == (Path("s.pem"), Path("s.key"), Path("ca.pem"))
    files = tls.TlsFiles(s.tls_cert, s.tls_key, s.tls_client_ca)
    assert (tls.TlsFiles().mode, files.mode) == ("plaintext", "mutual TLS")


def test_plaintext_off_loopback_is_logged(plain: Settings, caplog: pytest.LogCaptureFixture) -> None:
    assert all(tls.is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(tls.is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "encoder.internal"))
    with caplog.at_level(logging.INFO):
        EncoderServer(plain)._log_security(Keys(KeyRing([])))  # loopback: no warning, keys off said at info
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        EncoderServer(dataclasses.replace(plain, host="0.0.0.0"))._log_security(Keys(KeyRing(["a", "b"])))
    (record,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "plaintext gRPC on 0.0.0.0" in record.getMessage() and "API keys" in record.getMessage()
