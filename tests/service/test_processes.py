"""`mhaserve serve --processes N`: several server processes on one set of ports, under a supervisor.

Real processes on real loopback ports: which process answers is the kernel's choice (SO_REUSEPORT), so
the tests look at each process's own metrics port and at the supervisor's children in /proc.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service import processes
from mhaserve.service.metrics import Metrics
from mhaserve.service.settings import Settings, SettingsError
from mhaserve.testing.loopback import WAIT, free_port, free_port_run, wait_until
from mhaserve.testing.metrics import from_registry, scrape
from mhaserve.testing.process import ServerProcess, children

CALLS = 24


def _children(pid: int) -> list[int]:
    """The supervisor's server processes (its other child is multiprocessing's resource tracker)."""
    return children(pid, "mhaserve-p")


def _encode_on_a_new_connection(address: str, text: str) -> int:
    # A new channel with a subchannel of its own, a new connection: the kernel picks anew. (With grpc's global
    # subchannel pool, a channel made as the last one closed could take its connection, still open on a busy
    # machine: all 24 calls went to one process.)
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        reply = pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=[text]), timeout=WAIT)
    return len(reply.embeddings[0].values)


def _post_on_a_new_connection(http: int, text: str) -> int:
    body = json.dumps({"input": text}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{http}/v1/embeddings", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=WAIT) as response:  # urllib closes the connection after each
        return len(json.load(response)["data"][0]["embedding"])


def _count(metrics_port: int, method: str) -> float:
    return scrape(metrics_port).get("mhaserve_requests_total", 0.0, code="OK", method=method)


def _start(tiny_repo: Path, tmp_path: Path, n: int, *extra: str) -> tuple[ServerProcess, int, int]:
    http = free_port()
    metrics = free_port_run(n + 1, avoid=(http,))  # the supervisor's, then one per process
    server = ServerProcess(
        [
            *("--repository", str(tiny_repo), "--model", "tiny", "--device", "cpu", "--processes", str(n)),
            *("--port", "0", "--http-port", str(http), "--metrics-port", str(metrics), *extra),
        ],
        tmp_path / "serve.log",
    )
    wait_until(lambda: f"all {n} processes are serving" in server.log or server.proc.poll() is not None, "serving", 120)
    assert server.proc.poll() is None, server.log
    return server, metrics, http


@pytest.mark.slow
def test_two_processes_share_both_ports_and_stop_together_on_sigterm(tiny_repo: Path, tmp_path: Path) -> None:
    server, metrics, http = _start(tiny_repo, tmp_path, 2)
    with server:
        address = server.address()  # port 0: the supervisor chose it, and both processes listen on it
        listening = re.findall(r"listening on 127\.0\.0\.1:(\d+)", server.log)
        assert [int(p) for p in listening] == [server.port()] * 2
        children = _children(server.pid)
        assert len(children) == 2
        # On a CPU the processes share every core (a batch alone takes them all), each sized by its half.
        cpus = os.sched_getaffinity(0)
        assert [os.sched_getaffinity(pid) for pid in children] == [cpus, cpus]
        if len(cpus) >= 2:
            threads = f"intra-op threads per batch: all {len(cpus)} cores alone, {len(cpus) // 2} while another"
            assert server.log.count(threads) == 2, server.log
        assert [_encode_on_a_new_connection(address, f"text {i}") for i in range(CALLS)] == [32] * CALLS
        assert [_post_on_a_new_connection(http, f"text {i}") for i in range(CALLS)] == [32] * CALLS
        gathered = scrape(metrics)  # the supervisor's: every process's series, labelled by process
        for method in ("encoder.v1.EncoderService/Encode", "POST /v1/embeddings"):
            counts = [_count(metrics + 1 + i, method) for i in range(2)]  # each process's own port
            assert sum(counts) == CALLS, (method, counts)
            # The kernel hashed 24 connections over two listeners: both got some (all on one: p = 2^-23).
            assert min(counts) > 0, (method, counts)
            ok = {"code": "OK", "method": method}
            assert [gathered.get("mhaserve_requests_total", **ok, process=f"p{i}") for i in range(2)] == counts
        assert gathered.get("mhaserve_processes_serving") == 2
        assert gathered.get("mhaserve_process_restarts_total") == 0
        assert not gathered.has("mhaserve_requests_created")
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log
    assert server.log.count("mhaserve.service.server [-] stopped") == 2, server.log
    assert "mhaserve.service.processes [-] stopped: all 2 processes exited\n" in server.log, server.log
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]


@pytest.mark.slow
def test_a_process_that_dies_is_started_again_while_the_other_serves(tiny_repo: Path, tmp_path: Path) -> None:
    server, metrics, http = _start(tiny_repo, tmp_path, 2)
    with server:
        address = server.address()
        first, second = _children(server.pid)
        os.kill(first, signal.SIGKILL)
        # Gone from /proc, not just a zombie: a killed leader turns zombie while its other threads still
        # exit, and its listening sockets (which the kernel still hashes new connections to) close with the
        # last of them. A connection queued there then is reset: SO_REUSEPORT does not move it elsewhere.
        wait_until(lambda: not os.path.exists(f"/proc/{first}"), "the killed process to be gone and reaped")
        # Counted out as soon as the supervisor sees it exit, not when it is started again (a second later).
        wait_until(lambda: "starting it again" in server.log, "the supervisor to see the exit")
        assert scrape(metrics).get("mhaserve_processes_serving") == 1
        # Its listening sockets closed with it, and the new process joins the ports only once it serves:
        # meanwhile every new connection goes to the other process, and nothing is refused as "loading".
        sent = 0
        while "is serving again" not in server.log:
            assert _encode_on_a_new_connection(address, f"text {sent}") == 32
            sent += 1
            assert sent < 2000, server.log
        assert sent > 0
        assert "exited with status 137; starting it again" in server.log
        assert scrape(metrics).get("mhaserve_process_restarts_total") == 1
        again = _children(server.pid)
        assert second in again and first not in again and len(again) == 2
        assert server.proc.poll() is None
        server.signal(signal.SIGINT)
        assert server.wait() == 0, server.log


@pytest.mark.slow
def test_a_process_whose_loop_stops_is_killed_and_started_again(tiny_repo: Path, tmp_path: Path) -> None:
    """A process stopped (SIGSTOP here; a stuck event loop alike) kept its listening sockets, and the kernel went
    on handing it a share of the new connections, each waiting for its client's deadline, while the supervisor
    counted it as serving. Past --process-timeout without a turn of its loop it is killed and started again."""
    server, metrics, http = _start(tiny_repo, tmp_path, 2, "--process-timeout", "3")
    with server:
        address = server.address()
        first, second = _children(server.pid)
        os.kill(first, signal.SIGSTOP)
        wait_until(lambda: "is serving again" in server.log, "the stopped process to be started again", 60)
        killed = r"process p\d has not turned its event loop for [\d.]+ s .*: killing it"
        assert re.search(killed, server.log), server.log
        assert "exited with status 137; starting it again" in server.log
        assert not os.path.exists(f"/proc/{first}")
        again = _children(server.pid)
        assert second in again and first not in again and len(again) == 2
        gathered = scrape(metrics)
        assert gathered.get("mhaserve_process_restarts_total") == 1
        assert gathered.get("mhaserve_processes_serving") == 2
        assert [_encode_on_a_new_connection(address, f"text {i}") for i in range(CALLS)] == [32] * CALLS
        # A process that serves on is not killed: its loop turns every second, well within 3 s.
        time.sleep(4)
        assert server.log.count("killing it") == 1, server.log
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log


def test_the_process_timeout_is_refused_negative_or_shorter_than_a_healthy_process_can_keep() -> None:
    with pytest.raises(SettingsError, match="--process-timeout must be >= 0"):
        Settings(processes=2, process_timeout=-1)
    # a process notes its loop's turn once a second: 0.5 s killed every healthy one about once a second
    with pytest.raises(
        SettingsError, match=r"--process-timeout must be 0 \(never\) or at least 3 \(seconds\), got 0.5"
    ):
        Settings(processes=2, process_timeout=0.5)
    assert Settings(processes=2, process_timeout=0).process_timeout == 0
    assert Settings(processes=1, process_timeout=60).inert() == [
        ("process_timeout", "watches the processes of --processes 2 or more, not 1")
    ]
    assert Settings(processes=2, process_timeout=60).inert() == []


@pytest.mark.slow
def test_with_fixed_threads_each_process_is_pinned_to_its_share(tiny_repo: Path, tmp_path: Path) -> None:
    server, _, http = _start(tiny_repo, tmp_path, 2, "--intra-op-threads", "1")
    with server:
        shares = processes.core_shares(2)
        assert sorted(map(sorted, map(os.sched_getaffinity, _children(server.pid)))) == sorted(map(sorted, shares))
        assert server.log.count("intra-op threads per batch: 1\n") == 2, server.log
        assert [_post_on_a_new_connection(http, f"text {i}") for i in range(4)] == [32] * 4
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log


@pytest.mark.slow
def test_a_killed_supervisor_leaves_no_server_behind(tiny_repo: Path, tmp_path: Path) -> None:
    server, _, http = _start(tiny_repo, tmp_path, 2)
    with server:
        children = _children(server.pid)
        server.kill()  # SIGKILL: nothing of the supervisor runs; Linux tells its children (PR_SET_PDEATHSIG)
        wait_until(lambda: not [pid for pid in children if os.path.exists(f"/proc/{pid}")], "the processes to exit")
    with socket.socket() as s:  # and the port they shared is free again
        s.bind(("127.0.0.1", http))


def test_a_process_not_serving_is_scraped_as_not_ready() -> None:
    """While a process loads (or is started again, and again when it cannot serve) its own metrics port is not read,
    and the supervisor exported no mhaserve_ready for it: none at all while every process loaded, where one server
    exports 0, so MhaserveNotServing never saw a replica that loaded for ever or a process that crash-looped."""
    serving = Metrics()
    serving.ready.set(1)
    port = serving.serve("127.0.0.1", 0)
    try:
        children = [
            processes._Child(i, Settings(metrics_port=p), frozenset({0}), serving=i == 0)
            for i, p in enumerate((port, free_port()))
        ]
        registry = CollectorRegistry()
        registry.register(processes.Gathered(children, "127.0.0.1"))
        gathered = from_registry(registry)
        assert gathered.get("mhaserve_ready", -1, process="p0") == 1  # the serving one's own series
        assert gathered.get("mhaserve_ready", -1, process="p1") == 0  # the loading one's, the supervisor's word
        assert gathered.get("mhaserve_processes_serving") == 1
        children[0].serving = False  # every process loading: a series each, at 0
        gathered = from_registry(registry)
        assert [gathered.get("mhaserve_ready", -1, process=f"p{i}") for i in range(2)] == [0, 0]
        assert gathered.get("mhaserve_processes_serving") == 0
        # a serving process whose metrics cannot be read (stopped, frozen, draining): not ready either, and not
        # counted as serving (its series, ready included, were left out: the not-ready alert never fired for it)
        children[1].serving = children[0].serving = True
        gathered = from_registry(registry)
        assert [gathered.get("mhaserve_ready", -1, process=f"p{i}") for i in range(2)] == [1, 0]
        assert gathered.get("mhaserve_processes_serving") == 1
    finally:
        serving.close()


class _Both(BaseHTTPRequestHandler):
    """A process's metrics port that answers only once both processes' ports have been asked (a barrier of two):
    read one after another, the first waits for the second until the read times out, as a frozen process does."""

    barrier: threading.Barrier
    text = b"mhaserve_ready 1.0\n"

    def do_GET(self) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            self.barrier.wait(timeout=processes.SCRAPE_TIMEOUT_S * 2)
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.text)))
        self.end_headers()
        self.wfile.write(self.text)

    def log_message(self, *_: Any) -> None:
        pass


def test_the_processes_metrics_are_read_at_once_not_one_after_another(caplog: pytest.LogCaptureFixture) -> None:
    """Each process's port was read in turn, up to 2 s each: with two frozen, a scrape took 4 s, Prometheus'
    scrape_timeout here (deploy/prometheus), and failed whole (up 0, no series, the not-ready alert never saw the
    0s). Read at once, the two ports below, each answering only once both are asked, both answer."""
    handler = type("Handler", (_Both,), {"barrier": threading.Barrier(2)})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        children = [
            processes._Child(i, Settings(metrics_port=server.server_address[1]), frozenset({0}), serving=True)
            for i, server in enumerate(servers)
        ]
        registry = CollectorRegistry()
        registry.register(processes.Gathered(children, "127.0.0.1"))
        gathered = from_registry(registry)
        assert [gathered.get("mhaserve_ready", -1, process=f"p{i}") for i in range(2)] == [1, 1]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


class _CutShort(_Both):
    """A process's metrics port whose answer ends before its body does (the process killed between the headers
    and the body, which wsgiref writes apart), or with `cut` false whose body is not Prometheus' text."""

    cut = True

    def do_GET(self) -> None:
        body = b"# TYPE mhaserve_ready gauge\nmhaserve_ready 1.0\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:10] if self.cut else b"<html>not metrics</html>\n")


def test_a_process_whose_metrics_answer_is_cut_short_is_not_ready_and_the_others_are_scraped() -> None:
    """A process's answer cut short (http.client's IncompleteRead) or not metrics (a ValueError of the parser),
    neither an OSError, failed the whole scrape: every process's series, and the 0 that says which is not ready."""
    serving = Metrics()
    serving.ready.set(1)
    port = serving.serve("127.0.0.1", 0)
    broken = [ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_CutShort,), {"cut": cut})) for cut in (1, 0)]
    for server in broken:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ports = (port, *(server.server_address[1] for server in broken))
        children = [
            processes._Child(i, Settings(metrics_port=p), frozenset({0}), serving=True) for i, p in enumerate(ports)
        ]
        registry = CollectorRegistry()
        registry.register(processes.Gathered(children, "127.0.0.1"))
        gathered = from_registry(registry)
        assert [gathered.get("mhaserve_ready", -1, process=f"p{i}") for i in range(3)] == [1, 0, 0]
        assert gathered.get("mhaserve_processes_serving") == 1
    finally:
        serving.close()
        for server in broken:
            server.shutdown()
            server.server_close()


def test_a_draining_process_is_not_counted_as_serving(caplog: pytest.LogCaptureFixture) -> None:
    """mhaserve_processes_serving ("processes serving now") counted every process whose port answered, a
    draining one (its own mhaserve_ready 0) too; and while the server stops, a port that no longer answers is
    no warning (six of them on every deploy's orderly stop)."""
    draining = Metrics()
    draining.ready.set(0)
    port = draining.serve("127.0.0.1", 0)
    try:
        children = [
            processes._Child(i, Settings(metrics_port=p), frozenset({0}), serving=True)
            for i, p in enumerate((port, free_port()))
        ]
        registry = CollectorRegistry()
        stopping = False
        registry.register(processes.Gathered(children, "127.0.0.1", stopping=lambda: stopping))
        gathered = from_registry(registry)
        assert [gathered.get("mhaserve_ready", -1, process=f"p{i}") for i in range(2)] == [0, 0]
        assert gathered.get("mhaserve_processes_serving") == 0
        assert [r.levelname for r in caplog.records if "metrics could not be read" in r.getMessage()] == ["WARNING"]
        caplog.clear()
        stopping = True
        from_registry(registry)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        draining.close()


def test_a_port_in_use_is_an_error_before_any_process_starts(tiny_repo: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess(
            ["--repository", str(tiny_repo), "--processes", "2", "--port", str(port), "--metrics-port", "0"],
            tmp_path / "serve.log",
        )
        with server:
            assert server.wait() == 1
    assert f"cannot start: cannot listen on 127.0.0.1:{port}: Address already in use" in server.log
    assert "listening on" not in server.log


def test_a_processs_own_metrics_port_in_use_is_named_as_such() -> None:
    """A process's metrics port is --metrics-port + 1 and on, which the operator never named: "cannot listen on
    127.0.0.1:19804" sent them looking for a flag set to 19804 (two servers' metrics ports one apart)."""
    with socket.socket() as taken:
        for _ in range(50):
            base = free_port()
            try:
                taken.bind(("127.0.0.1", base + 1))
                break
            except OSError:
                continue
        taken.listen()
        settings = Settings(port=0, http_port=0, metrics_port=base, processes=2)
        with pytest.raises(processes.PortsError) as e:
            processes.claim_ports(settings)
    assert str(e.value) == (
        f"cannot listen on 127.0.0.1:{base + 1} (process p0's metrics: --metrics-port + 1): Address already in use"
    )


def test_a_grpc_port_the_kernel_chooses_is_none_of_the_other_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `--port 0` the supervisor has the kernel choose the gRPC port, then checks the metrics ports free:
    the kernel chose one of them (free then) in a CI run, and every process refused its settings ("--port and
    --metrics-port are both ..."). It is chosen again instead."""
    chosen = iter([9102, 8080, 9100, 40000])
    monkeypatch.setattr(processes, "_bind", lambda host, port, whose="": port or next(chosen))
    settings = Settings(port=0, http_port=8080, metrics_port=9100, processes=2)  # metrics 9100, 9101, 9102
    assert processes.claim_ports(settings).port == 40000
    # A port asked for is kept as it is (a clash with another is refused by the settings themselves).
    assert processes.claim_ports(Settings(port=50051, http_port=8080, metrics_port=9100, processes=2)).port == 50051


def test_a_process_failing_at_start_up_stops_the_supervisor_with_its_status(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    server = ServerProcess(
        ["--repository", str(tmp_path / "models"), "--processes", "2", "--port", "0", "--metrics-port", "0"],
        tmp_path / "serve.log",
    )
    with server:
        assert server.wait(WAIT * 2) == 1, server.log
    assert "while starting: stopping the others" in server.log


def test_explicit_model_control_needs_one_process() -> None:
    with pytest.raises(SettingsError, match="--model-control explicit needs --processes 1"):
        Settings(processes=2, model_control="explicit")
    with pytest.raises(SettingsError, match="--processes must be > 0"):
        Settings(processes=0)
    Settings(processes=2, model_control="poll")


def test_core_shares_cut_the_cpus_into_equal_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(processes, "available_cpus", lambda: 8)
    assert processes.core_shares(4) == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    assert processes.core_shares(3) == [{0, 1}, {2, 3}, {4, 5}]
    # A quota of 4 cores over 8 CPUs: two processes get 2 each, not 4.
    monkeypatch.setattr(processes, "available_cpus", lambda: 4)
    assert processes.core_shares(2) == [{0, 1}, {2, 3}]
    # More processes than cores: one core each, round the list.
    monkeypatch.setattr(processes, "available_cpus", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert processes.core_shares(3) == [{0}, {1}, {0}]


@pytest.mark.slow
def test_processes_signalled_twice_without_anyone_asking_twice_drain(tiny_repo: Path, tmp_path: Path) -> None:
    """systemd (or `pkill`) signals every process, and the supervisor passes its own on: each process got SIGTERM
    twice, took the second for an operator's "now", and cut its requests in flight (exit 143); so did Linux's
    death signal, sent again as a killed supervisor's threads hand its children on. They drain on any number."""
    server, _, _ = _start(tiny_repo, tmp_path, 2, "--drain-delay", "1")  # draining lasts a second at least
    with server:
        for pid in _children(server.pid):  # as a control group's stop: every process, then the supervisor
            os.kill(pid, signal.SIGTERM)
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log
    assert "exiting now" not in server.log and server.log.count("mhaserve.service.server [-] stopped") == 2


@pytest.mark.slow
def test_the_supervisors_second_signal_still_exits_at_once(tiny_repo: Path, tmp_path: Path) -> None:
    server, _, _ = _start(tiny_repo, tmp_path, 2, "--drain-delay", "20")
    with server:
        server.signal(signal.SIGTERM)
        wait_until(lambda: server.log.count("shutting down") == 2, "both processes draining")
        server.signal(signal.SIGINT)
        assert server.wait() == 128 + signal.SIGINT, server.log
    assert server.log.count("the supervisor's second signal while draining: exiting now") == 2, server.log


def test_a_signal_while_the_processes_start_is_passed_on_to_each_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM that came while a process was being started (its pid not yet the supervisor's to signal) was
    lost: every process started and served, and a second signal was needed to stop the server."""
    supervisor = processes.Supervisor(Settings(processes=3, port=0, metrics_port=0), log_level="info")
    pids = iter(range(1000, 1010))

    class Started:
        """A process whose start the signal interrupts (the first), or that starts as asked."""

        def __init__(self, **_: object) -> None:
            self.pid: int | None = None
            self.sentinel = -1

        def start(self) -> None:
            self.pid = next(pids)
            if self.pid == 1000:
                supervisor._signalled(signal.SIGTERM, None)

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(supervisor._ctx, "Process", Started)
    monkeypatch.setattr(processes, "claim_ports", lambda s: s)
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(supervisor, "_watch", lambda: None)
    supervisor.run()
    assert sent == [(1000, signal.SIGTERM)]  # passed on to the one started; the others not started at all
    assert [c.process is not None for c in supervisor._children] == [True, False, False]


def test_a_process_that_had_served_is_started_again_while_another_still_loads() -> None:
    """Any exit before every process had served was taken for a failed start-up, which stops the server: a process
    killed for its stopped loop (or dead otherwise) after it had served, while another still loaded a large model,
    took the whole server down with it (a review's finding). Started again, as once all serve."""
    supervisor = processes.Supervisor(Settings(processes=2, port=0, metrics_port=0), log_level="info")

    class Exited:
        pid, exitcode = 1000, -signal.SIGKILL

        def join(self) -> None:
            pass

    served, loading = (processes._Child(i, supervisor.settings, frozenset({0})) for i in range(2))
    supervisor._children = [served, loading]
    served.process, served.serving = Exited(), True  # type: ignore[assignment]
    supervisor._exited(served)
    assert served.restart_at is not None and not supervisor._signals and supervisor._status == 0
    loading.process = Exited()  # type: ignore[assignment]
    supervisor._exited(loading)  # one that never served: a failed start-up, as before
    assert supervisor._signals == [signal.SIGTERM] and supervisor._status == 137


def test_a_process_killed_while_the_server_stops_is_named_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """Its status became the server's (137) and nothing said which process, or that one was killed: the log's last
    line read "all 2 processes exited (status 137)", as if the supervisor itself had been (a review's finding)."""
    supervisor = processes.Supervisor(Settings(processes=2, port=0, metrics_port=0), log_level="info")

    class Killed:
        pid, exitcode = 1000, -signal.SIGKILL

        def join(self) -> None:
            pass

    children = [processes._Child(i, supervisor.settings, frozenset({0})) for i in range(2)]
    supervisor._children, supervisor._all_served, supervisor._signals = children, True, [signal.SIGTERM]
    children[1].process, children[1].serving = Killed(), True  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger=processes.log.name):
        supervisor._exited(children[1])
    assert supervisor._status == 137
    assert [r.getMessage() for r in caplog.records] == ["process p1 exited with status 137 while stopping"]


def test_a_process_started_again_under_poll_is_not_said_to_serve_other_versions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under poll the processes follow the repository: one started again after a version 2 was published serves
    version 2, as the others do by then, and was warned about for not serving what the first process served at
    start-up (a review's finding). The warning is for the start-up, where the processes read the repository
    apart."""
    polling = Settings(processes=2, port=0, metrics_port=0, model_control="poll")
    supervisor = processes.Supervisor(polling, log_level="info")

    class Ready:
        def __init__(self, served: object) -> None:
            self.served = served

        def recv(self) -> object:
            return self.served

        def close(self) -> None:
            pass

    children = [processes._Child(i, supervisor.settings, frozenset({0})) for i in range(2)]
    supervisor._children = children
    first, other = ({"m": {1: "a"}}, {"m": {1: "b"}})  # what two processes serve: not the same
    with caplog.at_level(logging.WARNING, logger=processes.log.name):
        children[0].ready = Ready(first)  # type: ignore[assignment]
        supervisor._heard(children[0])
        children[1].ready = Ready(other)  # type: ignore[assignment]
        supervisor._heard(children[1])  # at start-up: said
        assert [r.getMessage() for r in caplog.records] == [
            "process p1 serves other model versions than the first process to serve"
        ]
        caplog.clear()
        children[0].starts, children[0].ready = 2, Ready({"m": {2: "c"}})  # type: ignore[assignment]
        supervisor._heard(children[0])  # started again once all served, with what the repository now holds
        assert not caplog.records


def _versions_on_new_connections(address: str, calls: int) -> set[int]:
    found = set()
    for i in range(calls):
        with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:  # as above
            reply = pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=[f"t {i}"]), timeout=WAIT)
        found.add(reply.model_version)
    return found


@pytest.mark.slow
def test_a_process_started_again_serves_what_the_others_do(tiny_repo: Path, tmp_path: Path) -> None:
    """With --model-control none a process started again read the repository anew: with a version 2 published
    meanwhile it served that beside the others' version 1 (two vector spaces behind one address), and with a
    version overwritten in place, other weights under the same number. It serves the others' versions, as they
    were, or does not serve at all."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo, repo)
    server, metrics, _ = _start(repo, tmp_path, 2)
    with server:
        address = server.address()
        shutil.copytree(repo / "tiny" / "1", repo / "tiny" / "2")  # published while serving: not served
        first = _children(server.pid)[0]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: "is serving again" in server.log, "the process started again")
        assert _versions_on_new_connections(address, CALLS) == {1}, server.log
        # Version 1's serving config changed in place: the process started again refuses to serve it.
        (repo / "tiny" / "serving.json").write_text(json.dumps({"normalize": False}))
        os.kill(_children(server.pid)[0], signal.SIGKILL)
        wait_until(lambda: "is not what the other processes serve" in server.log, "the refusal")
        assert _versions_on_new_connections(address, 8) == {1}  # the other process serves on
        # Started again and again, it never serves: the alerts see it (MhaserveNotServing, MhaserveProcessRestarts).
        gathered = scrape(metrics)
        assert sorted(gathered.get("mhaserve_ready", -1, process=f"p{i}") for i in range(2)) == [0, 1]
        assert gathered.get("mhaserve_process_restarts_total") >= 2
        server.signal(signal.SIGTERM)
        assert server.wait() == 0, server.log
