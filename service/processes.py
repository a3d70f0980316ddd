"""`mhaserve serve --processes N`: N server processes on the same ports, and a supervisor over them.

Why: one process answers one-text requests no faster than its Python runs, under one interpreter lock
(about 1,200 a second on an H200 host, whatever the GPU does: docs/gpu.md). N processes, each with its
own interpreter, model session and batcher, multiply that. Each binds the same gRPC and HTTP ports with
SO_REUSEPORT, and the kernel spreads new connections over them; a connection stays with the process
that accepted it, as behind any layer-4 balancer.

The supervisor loads no model and answers no call. Before starting the processes it checks the ports are free
(and picks the gRPC port when it is 0), so that they all bind the same ones and a port in use is still an
error, and reads the keys and TLS files: every process it starts, then or again later, serves with what it read
then (credentials.py), as one server does with what it read as it started. It serves every process's metrics on
--metrics-port, each series labelled with its `process` (p0, p1, ...), fetched from process i's own metrics
port, --metrics-port + 1 + i, at each scrape: one target for Prometheus, as with one process (a process that
does not serve, loading or started again, is there as `mhaserve_ready{process="pN"} 0`, as one server says 0
while it loads). Each process sizes its inference workers and thread pools by its share of the cores (1/N), not
by the whole machine. On a CPU the processes share every core: a batch that starts while another process
computes runs on its share's threads, and one that starts while none does takes every core, so that a lone
request runs on every core as with one (the processes count their runs in progress in a small table of shared
memory; server.CoreShare). On a GPU, or with --intra-op-threads fixed, process i is pinned to the i-th share
instead (CPU affinity).

The supervisor forwards SIGTERM and SIGINT, and on a second one tells the processes to exit at once (EXIT_NOW:
they drain on SIGTERM and SIGINT however often those reach them, from the supervisor, systemd or `pkill`). A
process that fails while the processes start stops them all, with its status, as a single server would;
one that exits once all have served is started again, while the others go on answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import http.client
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, MutableSequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from mhaserve.runtime.cpus import available_cpus
from mhaserve.service.auth import AuthError
from mhaserve.service.credentials import Credentials
from mhaserve.service.metrics import READY, READY_HELP, serve_metrics
from mhaserve.service.models import Served
from mhaserve.service.settings import Settings, on_cpu
from mhaserve.service.tls import TlsError

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
FIRST_RESTART_DELAY_S = 1.0
# How often a serving process notes the time its event loop turned (_beat), for the supervisor's --process-timeout.
BEAT_S = 1.0
MAX_RESTART_DELAY_S = 30.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# What the supervisor sends its processes on its own second SIGTERM or SIGINT: exit at once. Theirs may reach
# them twice without anyone asking twice (server.serve's `exit_now`), so on those they only drain.
EXIT_NOW = signal.SIGUSR2


class PortsError(RuntimeError):
    """A port the processes would share is in use or cannot be bound."""


def claim_ports(settings: Settings) -> Settings:
    """The settings with the ports every process binds: each checked free by binding it now (without
    SO_REUSEPORT, so that another program's listener is found), the gRPC port chosen when it is 0; and
    the metrics ports, the supervisor's and one per process after it."""
    last = settings.metrics_port + settings.processes  # at most 65535: Settings refuses more
    metrics = range(settings.metrics_port, last + 1) if settings.metrics_port else range(0)
    # A gRPC port the kernel chooses is free now, and so may be one of the others, which nothing holds yet:
    # chosen again then (a process given the same port twice refuses its settings and the start fails).
    taken = {*metrics, settings.http_port}
    grpc_port = _bind(settings.host, settings.port)
    for _ in range(100):
        if settings.port or grpc_port not in taken:
            break
        grpc_port = _bind(settings.host, 0)
    if settings.http_port:
        _bind(settings.host, settings.http_port, " (--http-port)")
    for i, port in enumerate(metrics):
        # the processes' own are past the one asked for, which an operator never named: said which they are
        whose = " (--metrics-port)" if i == 0 else f" (process p{i - 1}'s metrics: --metrics-port + {i})"
        _bind(settings.metrics_address, port, whose)
    return dataclasses.replace(settings, port=grpc_port)


def _bind(host: str, port: int, whose: str = "") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as e:
            raise PortsError(f"cannot listen on {host}:{port}{whose}: {e.strerror}") from None
        return int(sock.getsockname()[1])


def core_shares(processes: int) -> list[frozenset[int]]:
    """Each process's cores: this process's CPUs cut into `processes` shares of equal size, as many cores
    each as its cgroup quota allows them (a share is reused round the list when there are more processes
    than cores)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, available_cpus() // processes)  # available_cpus() is already the affinity cut by the quota
    return [frozenset(cpus[(i * per + k) % len(cpus)] for k in range(per)) for i in range(processes)]


def _die_with_parent(supervisor: int) -> None:
    """Ask Linux for SIGTERM when the supervisor dies, so that a killed supervisor leaves no server
    holding its ports: the process drains and exits as if it had been told to."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    # The supervisor died before the request took effect: this process was handed to another parent.
    # (Compared with the supervisor's pid, not with 1: in a container the supervisor is pid 1.)
    if os.getppid() != supervisor:
        os.kill(os.getpid(), signal.SIGTERM)


def _process_main(
    settings: Settings,
    index: int,
    cores: frozenset[int],
    level: str,
    ready: Connection,
    supervisor: int,
    peers: MutableSequence[int] | None,
    pinned: Served | None,
    credentials: Credentials,
    beats: MutableSequence[float],
) -> None:
    """One server process (the spawned child's entry point). With `peers` it shares every core with the
    others (CoreShare) and sizes itself by as many as `cores` holds; without, it is pinned to `cores`. It sends
    `ready` what it serves once it does; `pinned`: serve what the others do (a process started again);
    `credentials`: the keys and TLS material the supervisor read at start-up, served with as they were; `beats`:
    where it notes, once it serves, when its event loop last turned (the supervisor's --process-timeout)."""
    # Before anything else (the imports below take a second): a SIGINT the supervisor passes on while this
    # process starts ends it quietly, as SIGTERM does, where Python's KeyboardInterrupt printed a traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from mhaserve.service.context import configure_logging
    from mhaserve.service.server import CoreShare, serve
    from mhaserve.service.threads import name_this_thread

    # Its own process group: a terminal's Ctrl-C reaches the supervisor alone, which passes it on once.
    os.setpgid(0, 0)
    _die_with_parent(supervisor)
    share = None if peers is None else CoreShare(len(cores), peers, index)
    if share is None:
        os.sched_setaffinity(0, cores)
    name_this_thread(f"mhaserve-p{index}")  # what top and ps show, instead of the spawning interpreter's name
    configure_logging(level, process=f"p{index}")

    def on_serving(served: Served) -> None:
        _beat(asyncio.get_running_loop(), beats, index)  # before the supervisor hears it serves, and watches
        ready.send(served)

    serving = serve(
        settings, on_serving=on_serving, share=share, exit_now=EXIT_NOW, pinned=pinned, credentials=credentials
    )
    try:
        code = asyncio.run(serving)
    finally:
        # Its loop has closed, and the process exits (joining its threads, closing its sessions): not to be killed
        # for that as a loop that stopped turning.
        beats[index] = math.inf
    ready.close()
    sys.exit(code)


def _beat(loop: asyncio.AbstractEventLoop, beats: MutableSequence[float], index: int) -> None:
    """Note that this process's event loop turns now, and again in BEAT_S, for as long as it runs (a drain too)."""
    beats[index] = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process of the machine
    loop.call_later(BEAT_S, _beat, loop, beats, index)


@dataclass
class _Child:
    index: int
    settings: Settings
    cores: frozenset[int]
    process: BaseProcess | None = None
    ready: Connection | None = None  # the supervisor's end of the pipe the process says "serving" on
    serving: bool = False
    starts: int = 0
    restart_at: float | None = None
    delay: float = FIRST_RESTART_DELAY_S
    killed: bool = False  # by the supervisor, its loop stopped (--process-timeout): killed once


def _status(process: BaseProcess) -> int:
    """A child's exit status as a shell reports it: 128 + the signal's number when a signal ended it."""
    code = process.exitcode
    assert code is not None
    return 128 - code if code < 0 else code


class Gathered:
    """The Prometheus collector behind the supervisor's metrics port: at each scrape, every serving
    process's metrics, each series labelled with its process, `mhaserve_ready 0` for each process that does not
    serve, and the supervisor's own two."""

    def __init__(self, children: list[_Child], host: str, stopping: Callable[[], bool] = lambda: False) -> None:
        self.children = children
        # Processes bind their metrics to --metrics-host (or --host); a wildcard address is reached on loopback.
        self.host = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1", "": "127.0.0.1"}.get(host, host)
        self.stopping = stopping  # the server stops: a process whose port no longer answers is no surprise

    def _read(self, port: int) -> str:
        host = f"[{self.host.strip('[]')}]" if ":" in self.host else self.host
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
            return str(reply.read().decode())

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        serving = 0

        def not_ready(child: _Child) -> None:
            ready = families.setdefault(READY, GaugeMetricFamily(READY, READY_HELP, labels=["process"]))
            ready.add_sample(READY, {"process": f"p{child.index}"}, 0.0)

        # Still loading, or starting again (and again, when it cannot serve): its series come with it, but its
        # readiness is known now. Without it, alerts on mhaserve_ready == 0 saw nothing of a process that loads for
        # ever or crash-loops, where one server exports 0 from its first scrape.
        asked = [c for c in self.children if c.serving and c.settings.metrics_port]
        # Every port at once: read in turn, up to SCRAPE_TIMEOUT_S each, two frozen processes took the scrape past
        # Prometheus' timeout (4 s in deploy/prometheus), and it failed whole, their 0s with it.
        with ThreadPoolExecutor(max_workers=max(1, len(asked))) as pool:
            reads = {c.index: pool.submit(self._read, c.settings.metrics_port or 0) for c in asked}
        for child in self.children:
            read = reads.get(child.index)
            if read is None:
                not_ready(child)
                continue
            try:
                read_families = list(text_string_to_metric_families(read.result()))
            except (OSError, http.client.HTTPException, ValueError) as e:
                # Stopped, frozen, or draining: not ready, as far as anyone can tell (its series, its readiness
                # included, were left out, and the not-ready alert never fired for a frozen process). An answer cut
                # short (killed as it answered) or not Prometheus' text is neither an OSError: it failed the whole
                # scrape, every process's series with it.
                (log.debug if self.stopping() else log.warning)("process p%d's metrics could not be read: %s",
                                                                 child.index, e or type(e).__name__)  # fmt: skip
                not_ready(child)
                continue
            ready = False
            for family in read_families:
                ready = ready or (family.name == READY and any(sample.value == 1 for sample in family.samples))
                if family.name.endswith("_created"):  # creation times: noise, and one per process
                    continue
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                label = {"process": f"p{child.index}"}
                merged.samples.extend(
                    sample._replace(labels=sample.labels | label)
                    for sample in family.samples
                    if not sample.name.endswith("_created")
                )
            serving += ready  # by its own word: one that answers while it drains (or stalls) says 0
        yield from families.values()
        yield GaugeMetricFamily(
            "mhaserve_processes_serving",
            "Server processes serving now, of --processes",
            value=serving,
        )
        yield CounterMetricFamily(
            "mhaserve_process_restarts",
            "Server processes started again after they exited",
            value=sum(max(0, c.starts - 1) for c in self.children),
        )


class Supervisor:
    """Starts the processes, watches them, passes signals on; `run()` returns the exit status."""

    def __init__(self, settings: Settings, *, log_level: str) -> None:
        self.settings = settings
        self.log_level = log_level
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a process that has threads
        self._children: list[_Child] = []
        self._signals: list[int] = []
        # Each process's runs in progress, for processes that share the cores (_process_main); None: pinned.
        self._peers: MutableSequence[int] | None = None
        if on_cpu(settings.device) and not settings.intra_op_threads:
            self._peers = self._ctx.RawArray("i", settings.processes)
        # When each serving process's event loop last turned (_beat), on the clock of time.monotonic.
        self._beats: MutableSequence[float] = self._ctx.RawArray("d", settings.processes)
        self._all_served = False
        self._status = 0
        # What the first process to serve serves: with --model-control none, a process started again serves the
        # same (the versions its policy selected then, as they were), not what the repository holds by then:
        # it read the repository anew, and one server served two versions of a model, or two sets of models.
        self._served: Served | None = None
        # The keys and TLS material every process serves with, one started again too: read once, here (run()).
        self._credentials: Credentials | None = None

    def run(self) -> int:
        s = self.settings
        # Imported here, not at the top: a spawned process imports this module before it sets its SIGINT handler
        # (_process_main), and the server's modules take a second to import.
        from mhaserve.service.server import read_credentials

        try:
            self._credentials = read_credentials(s)
            shared = claim_ports(s)
        except (AuthError, TlsError, PortsError) as e:
            log.error("cannot start: %s", e)
            return 1
        shares = core_shares(s.processes)
        for i, cores in enumerate(shares):
            metrics = s.metrics_port + 1 + i if s.metrics_port else 0
            own = dataclasses.replace(
                # (the timeout is the supervisor's: a process's own would be said to be without effect)
                shared,
                processes=1,
                reuse_port=True,
                metrics_port=metrics,
                process_timeout=Settings.process_timeout,
            )
            self._children.append(_Child(i, own, cores))
        metrics_server = None
        if s.metrics_port:
            registry = CollectorRegistry()
            registry.register(Gathered(self._children, s.metrics_address, stopping=lambda: bool(self._signals)))
            try:
                metrics_server = serve_metrics(registry, s.metrics_address, s.metrics_port)
            except OSError as e:
                log.error(
                    "cannot start: cannot serve metrics on %s:%d: %s", s.metrics_address, s.metrics_port, e.strerror
                )
                return 1
        log.info(
            "%d server processes on gRPC %s:%d%s, %s%s",
            s.processes,
            s.host,
            shared.port,
            f" and HTTP port {s.http_port}" if s.http_port else "",
            f"{len(shares[0])} core(s) each"
            if self._peers is None
            else f"sharing {available_cpus()} cores: each sized by {len(shares[0])}, a batch alone on all",
            f"; every process's metrics on port {s.metrics_port}, process i's alone on {s.metrics_port} + 1 + i"
            if s.metrics_port
            else "",
        )
        previous = {sig: signal.signal(sig, self._signalled) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for c in self._children:
                if self._signals:  # told to stop while starting them: the rest are not started
                    break
                self._start(c)
            self._watch()
            # Each process logs its own "stopped"; this line says the whole server has.
            status = f" (status {self._status})" if self._status else ""
            log.info("stopped: all %d processes exited%s", s.processes, status)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if metrics_server is not None:
                server, thread = metrics_server
                server.shutdown()
                server.server_close()
                thread.join(timeout=5)
        return self._status

    def _start(self, child: _Child) -> None:
        ours, theirs = self._ctx.Pipe(duplex=False)
        pinned = self._served if child.settings.model_control == "none" else None  # poll: it reads as they do
        assert self._credentials is not None  # run() read them
        process = self._ctx.Process(
            target=_process_main,
            args=(
                *(child.settings, child.index, child.cores, self.log_level, theirs, os.getpid(), self._peers),
                *(pinned, self._credentials, self._beats),
            ),
            name=f"mhaserve-p{child.index}",
        )
        process.start()
        theirs.close()
        child.process, child.ready, child.serving, child.restart_at = process, ours, False, None
        child.killed = False
        child.starts += 1
        log.debug("process p%d started: pid %s, cores %s", child.index, process.pid, sorted(child.cores))
        if self._signals:  # one came while it was being started, before it was among those to pass it on to
            self._forward(child, self._forwarded())

    def _signalled(self, signum: int, _frame: FrameType | None) -> None:
        self._signals.append(signum)
        if len(self._signals) > 1:  # told again: every process exits at once, and so does the server
            self._status = 128 + signum
        for child in self._children:
            child.restart_at = None  # a stopping supervisor starts nothing again
            self._forward(child, self._forwarded())

    def _forwarded(self) -> int:
        """What the processes are sent for the signals the supervisor got: the first as it came (they drain on
        it, however often it reaches them), EXIT_NOW for any after it."""
        return self._signals[0] if len(self._signals) == 1 else EXIT_NOW

    def _forward(self, child: _Child, signum: int) -> None:
        if child.process is not None and child.process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.process.pid, signum)

    def _watch(self) -> None:
        while any(c.process is not None or c.restart_at is not None for c in self._children):
            waiting: dict[Any, _Child] = {}  # a sentinel (int) or a Connection
            for c in self._children:
                if c.process is not None:
                    waiting[c.process.sentinel] = c
                    if c.ready is not None:
                        waiting[c.ready] = c
            for ready in wait(list(waiting), timeout=0.5):
                child = waiting[ready]
                if ready is child.ready:
                    self._heard(child)
                elif child.process is not None:
                    self._exited(child)
            now = time.monotonic()
            for c in self._children:
                if c.restart_at is not None and c.restart_at <= now and not self._signals:
                    self._start(c)
            self._kill_stopped(now)

    def _kill_stopped(self, now: float) -> None:
        """Kill each serving process whose event loop has not turned for --process-timeout (stuck, or stopped by
        SIGSTOP): its listening sockets took their share of the new connections, each of which waited for its
        client's deadline, while it was counted as serving. Its exit is then handled as any (_exited: started
        again, unless the server stops; a stuck process would also have held the stop for ever)."""
        timeout = self.settings.process_timeout
        for c in self._children:
            if not timeout or not c.serving or c.killed or c.process is None or c.process.pid is None:
                continue
            if (quiet := now - self._beats[c.index]) > timeout:
                log.error(
                    "process p%d has not turned its event loop for %g s (--process-timeout %g: stuck, or stopped): "
                    "killing it",
                    c.index,
                    round(quiet, 1),
                    timeout,
                )
                c.killed = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.process.pid, signal.SIGKILL)

    def _heard(self, child: _Child) -> None:
        assert child.ready is not None
        try:
            served = child.ready.recv()
        except EOFError:  # the process is exiting; its sentinel says how
            pass
        else:
            if self._served is None:
                self._served = served
            elif served != self._served and not self._all_served:  # the repository changed while they first loaded
                # (once all serve, one started again serves what it is pinned to, or under poll what the repository
                # holds by then, as the others do)
                log.warning("process p%d serves other model versions than the first process to serve", child.index)
            child.serving = True
            child.delay = FIRST_RESTART_DELAY_S
            if child.starts > 1:
                log.info("process p%d is serving again", child.index)
        child.ready.close()
        child.ready = None
        if not self._all_served and all(c.serving for c in self._children):
            self._all_served = True
            log.info("all %d processes are serving", len(self._children))

    def _exited(self, child: _Child) -> None:
        assert child.process is not None
        child.process.join()
        code = _status(child.process)
        served, child.serving = child.serving, False  # now, not when it is started again (a second or more later)
        child.process = None
        if self._peers is not None:
            self._peers[child.index] = 0  # it may have died computing: its runs are no longer in progress
        if child.ready is not None:
            child.ready.close()
            child.ready = None
        if self._signals:
            # Stopping: the status is the first failure, if any, of a process that served (or of the first start).
            # One the signal passed on ended before it could drain stopped as it was asked to; one starting again
            # failed before the stop, and the restarts were handling that.
            if code not in (0, 128 + self._signals[0]) and (served or not self._all_served):
                # said here: the process itself said nothing (killed), and the server's status will be this one's
                log.warning("process p%d exited with status %d while stopping", child.index, code)
                self._status = self._status or code
            return
        if not self._all_served and not served:
            # Start-up failed (a model that does not load, no memory for another session): as one server would. One
            # that had served (killed for its stopped loop, say) while another still loads is started again below.
            log.error("process p%d exited with status %d while starting: stopping the others", child.index, code)
            self._status = code or 1
            self._signalled(signal.SIGTERM, None)
            return
        log.warning(
            "process p%d exited with status %d; starting it again in %g s (the others go on serving)",
            child.index,
            code,
            child.delay,
        )
        child.restart_at = time.monotonic() + child.delay
        child.delay = min(MAX_RESTART_DELAY_S, 2 * child.delay)


def supervise(settings: Settings, *, log_level: str) -> int:
    """`mhaserve serve` with --processes above 1."""
    return Supervisor(settings, log_level=log_level).run()
