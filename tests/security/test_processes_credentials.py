"""Keys and TLS under `mhaserve serve --processes N`: every process, started again or not, serves with what the
supervisor read at start-up, as one server does with what it read; files changed since are read at the next
start of the server, not of one of its processes.

Real processes on real loopback ports: which process answers a new connection is the kernel's choice
(SO_REUSEPORT), so each check runs over many connections and each process's own metrics port says that both
answered some.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mhaserve.service import processes
from mhaserve.service.settings import Settings
from mhaserve.testing.loopback import WAIT, free_port, free_port_run, wait_until
from mhaserve.testing.metrics import scrape
from mhaserve.testing.process import ServerProcess, children
from tests.security.conftest import Pki

CONNECTIONS = 24  # over two listeners: all on one has p = 2^-23
OLD, NEW = "old-key-111", "new-key-222"


def _start(tiny_repo: Path, tmp_path: Path, *extra: str) -> tuple[ServerProcess, int, int]:
    http = free_port()
    metrics = free_port_run(3, avoid=(http,))  # the supervisor's, then one per process
    server = ServerProcess(
        [
            *("--repository", str(tiny_repo), "--model", "tiny", "--device", "cpu", "--processes", "2"),
            *("--port", "0", "--http-port", str(http), "--metrics-port", str(metrics), *extra),
        ],
        tmp_path / "serve.log",
    )
    wait_until(lambda: "all 2 processes are serving" in server.log or server.proc.poll() is not None, "serving", 120)
    assert server.proc.poll() is None, server.log
    return server, metrics, http


def _restart_one(server: ServerProcess, times: int) -> None:
    """Kill one server process and wait until the supervisor has it serving again (`times` in all)."""
    os.kill(children(server.pid, "mhaserve-p")[0], signal.SIGKILL)
    wait_until(
        lambda: server.log.count("is serving again") == times or "starting it again in 2 s" in server.log,
        "the process started again",
        60,
    )
    assert server.log.count("is serving again") == times, server.log  # not failing to start, again and again


def _models(http: int, key: str) -> int:
    """GET /v1/models with `key`, on a new connection (urllib makes one a request): the HTTP status."""
    request = urllib.request.Request(f"http://127.0.0.1:{http}/v1/models", headers={"authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


def _answered(metrics: int, code: str, method: str) -> list[float]:
    """How many calls each process answered with `code` (its own metrics port, after the supervisor's)."""
    return [scrape(metrics + 1 + i).get("mhaserve_requests_total", 0.0, code=code, method=method) for i in range(2)]


@pytest.mark.slow
def test_a_process_started_again_takes_the_keys_read_at_start(tiny_repo: Path, tmp_path: Path) -> None:
    """A process started again read --api-keys-file anew: with the file rotated meanwhile (for a restart
    later: the keys are read once, at start-up), the old key and the new each worked on about half the
    connections behind one port; with the file empty or half written then, the process failed to start, again
    and again, and the server ran on fewer processes."""
    keys, admin = tmp_path / "keys", tmp_path / "admin-keys"
    keys.write_text(f"{OLD}\n")
    admin.write_text("admin-key-333\n")
    server, metrics, http = _start(tiny_repo, tmp_path, "--api-keys-file", str(keys), "--admin-keys-file", str(admin))
    with server:
        keys.write_text(f"{NEW}\n")
        _restart_one(server, 1)
        assert [_models(http, OLD) for _ in range(CONNECTIONS)] == [200] * CONNECTIONS
        assert [_models(http, NEW) for _ in range(CONNECTIONS)] == [401] * CONNECTIONS
        # Both processes answered both keys: the one started again too.
        assert min(_answered(metrics, "OK", "GET /v1/models")) > 0
        assert min(_answered(metrics, "UNAUTHENTICATED", "GET /v1/models")) > 0
        keys.write_text("")
        admin.write_text("")
        _restart_one(server, 2)
        assert [_models(http, OLD) for _ in range(CONNECTIONS)] == [200] * CONNECTIONS
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log
    assert "cannot start" not in server.log


def _certificate(port: int) -> bytes:
    """The certificate a TLS port presents, on a new connection (none checked: a changed one is seen)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as raw, context.wrap_socket(raw) as tls:
        certificate = tls.getpeercert(binary_form=True)
    assert certificate is not None
    return certificate


def _embed(port: int) -> bytes:
    """POST /v1/embeddings over TLS on a new connection: the certificate it was answered under."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=WAIT, context=context)
    try:
        connection.request("POST", "/v1/embeddings", b'{"input": "t"}', {"content-type": "application/json"})
        assert connection.getresponse().status == 200
        assert connection.sock is not None
        certificate = connection.sock.getpeercert(binary_form=True)
    finally:
        connection.close()
    assert certificate is not None
    return certificate


@pytest.mark.slow
def test_a_process_started_again_presents_the_certificate_read_at_start(
    tiny_repo: Path, tmp_path: Path, pki: Pki
) -> None:
    """A process started again read --tls-cert and --tls-key anew: with them renewed meanwhile, clients met
    two certificates behind one port; the renewal is the server's to take at its next start."""
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    shutil.copy(pki.server_cert, cert)
    shutil.copy(pki.server_key, key)
    served = ssl.PEM_cert_to_DER_cert(cert.read_text())
    server, metrics, https = _start(tiny_repo, tmp_path, "--tls-cert", str(cert), "--tls-key", str(key))
    with server:
        shutil.copy(pki.client_cert, cert)  # another certificate and its key: a usable pair
        shutil.copy(pki.client_key, key)
        _restart_one(server, 1)
        assert {_certificate(server.port()) for _ in range(CONNECTIONS)} == {served}
        assert {_embed(https) for _ in range(CONNECTIONS)} == {served}
        assert min(_answered(metrics, "OK", "POST /v1/embeddings")) > 0  # the process started again answered too
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log


def test_files_the_supervisor_cannot_read_stop_it_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The supervisor reads the files once, for every process: one it cannot read (emptied since the settings
    were checked) stops the server as a single server's start-up would, before any process starts."""
    empty = tmp_path / "keys"
    empty.write_text("# rotated\n")
    supervisor = processes.Supervisor(
        Settings(processes=2, port=0, metrics_port=0, api_keys_file=empty), log_level="info"
    )

    def started(**_: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(supervisor._ctx, "Process", started)
    assert supervisor.run() == 1
    assert f"cannot start: --api-keys-file {empty} holds no key" in caplog.text
