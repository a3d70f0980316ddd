"""The server side of the benchmark: a real `mhaserve serve` subprocess and a cheap load generator.

The load generator is one asyncio loop of coroutines, one per simulated client, each sending its next
request as soon as the previous one returns (a closed loop), over gRPC or HTTP (transports.py); or, for
`grpc-sync`, one client on a synchronous stub looping in the calling thread. Its own CPU time is measured,
with the server's and the whole machine's, because on a small machine they share the same cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import grpc

from mhaserve.loadtest.bench.options import GRPC_SYNC, server_processes
from mhaserve.loadtest.bench.quiet import (
    busy_cores,
    machine_cpu,
    process_cpu_seconds,
    self_cpu_seconds,
    thread_cpu_seconds,
)
from mhaserve.loadtest.bench.transports import CallFailed, GrpcSyncClient, Transport, transport
from mhaserve.loadtest.bench.workloads import Workload
from mhaserve.loadtest.stats import latency_summary
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.loopback import free_port_run, free_ports
from mhaserve.testing.metrics import Samples, scrape
from mhaserve.testing.process import Memory, children, memory


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why."""


class _PortTaken(Exception):
    """The server could not bind a port chosen for it: something else took it in between."""


# What the server's log says, from gRPC core or from the OS error its HTTP and metrics servers report, when a
# port it was given is bound by someone else (EADDRINUSE's message).
_PORT_IN_USE = "Address already in use"


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Stop a server process as a deployment does, with SIGTERM; killed if it has not exited in `timeout` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Server:
    """`mhaserve serve` on free ports, its log in a file; stopped with SIGTERM, as a deployment stops it.

    With `--processes N` among its flags it is a supervisor and N server processes: their CPU and memory
    are summed (the supervisor's metrics are every process's already), and the gRPC clients get a channel
    each."""

    def __init__(
        self,
        repository: Path,
        *,
        models: Sequence[str],
        batching: str,
        graph: str,
        device: str,
        threads: int | None,
        extra: Sequence[str],
        log_path: Path,
        grpc_client: str = "aio",
    ) -> None:
        self.batching = batching
        self.grpc_client = grpc_client  # how the bench's gRPC clients reach it (transports.transport)
        self.processes = server_processes(extra)
        self._serve_args = [
            sys.executable, "-m", "mhaserve.cli", "serve",
            "--repository", str(repository),
            "--batching", batching,
            "--graph", graph,
            "--device", device,
            "--grace-period", "5",
            *(a for m in models for a in ("--model", m)),
            *(["--intra-op-threads", str(threads)] if threads else []),
            *extra,
        ]  # fmt: skip
        self._choose_ports()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def _choose_ports(self) -> None:
        self.port, self.metrics_port, self.http_port = free_ports(3)
        if self.processes > 1:  # the supervisor's port, and process i's own after it (metrics_port + 1 + i)
            self.metrics_port = free_port_run(1 + self.processes, avoid=(self.port, self.http_port))
        self.address = f"127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        ports = ["--port", str(self.port), "--metrics-port", str(self.metrics_port), "--http-port", str(self.http_port)]
        # the address its clients dial: an MHASERVE_HOST inherited had the server listen elsewhere, and the bench
        # waited its start-up timeout for a server that was serving
        self.args = [*self._serve_args, *ports, "--host", "127.0.0.1"]

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the server wrote, for an error message that says why it stopped."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout: float = 180.0, attempts: int = 3) -> pb.GetModelInfoResponse:
        """Start it and wait for SERVING; its default model's info.

        A free port is free only when it is chosen: another process may take it before the server, a second
        later, binds it. The server then exits saying so, and it is started again on new ports, up to
        `attempts` times in all; any other exit is an error at once, with the log's last lines."""
        self.log_path.write_bytes(b"")
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(timeout)
            except _PortTaken:
                if attempt == attempts:
                    raise BenchError(f"a port was taken {attempts} times in a row:\n{self.log_tail()}") from None
                tried = f"gRPC {self.port}, metrics {self.metrics_port}, HTTP {self.http_port}"
                self._choose_ports()
                with self.log_path.open("a") as log:  # the log keeps every attempt
                    log.write(f"[bench] a port was in use ({tried}): starting again on new ports\n")
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> pb.GetModelInfoResponse:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._log = self.log_path.open("ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.proc.poll() is not None:
                    self._log.close()
                    tail = self.log_tail()
                    if _PORT_IN_USE in tail:
                        raise _PortTaken()
                    raise BenchError(
                        f"the server exited with status {self.proc.returncode}: {self.log_path} ends\n{tail}"
                    )
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    # With several processes, each binds the port once it serves: wait for them all.
                    if status == health_pb2.HealthCheckResponse.SERVING and (
                        self.processes == 1 or f"all {self.processes} processes are serving" in self.log_tail(400)
                    ):
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise BenchError(
                        f"the server was not SERVING after {timeout:.0f} s: {self.log_path} ends\n{self.log_tail()}"
                    )
                time.sleep(0.2)
        return self.model_info()

    def model_info(self, model: str = "") -> pb.GetModelInfoResponse:
        """A served model's info (the default model's when `model` is empty)."""
        with grpc.insecure_channel(self.address) as channel:
            info: pb.GetModelInfoResponse = pb_grpc.EncoderServiceStub(channel).GetModelInfo(
                pb.GetModelInfoRequest(model=model), timeout=10
            )
        return info

    def memory(self) -> Memory:
        """The server's resident and peak memory now (from /proc), its processes' together."""
        if self.processes == 1:
            return memory(self.pid)
        return Memory.total([memory(pid) for pid in self.pids()])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pids(self) -> list[int]:
        """The server's processes: the one started, and with --processes the server processes under it."""
        return [self.pid] if self.processes == 1 else [self.pid, *children(self.pid, "mhaserve-p")]

    @property
    def own_channels(self) -> bool:
        """Whether each gRPC client needs a channel (a connection) of its own to reach every process."""
        return self.processes > 1

    def scrape(self) -> Samples:
        """The server's metrics (with --processes, the supervisor's: every process's series, which a sum
        over the `process` label adds up)."""
        return scrape(self.metrics_port, timeout=5)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        terminate(self.proc, timeout=30)
        if self._log is not None:
            self._log.close()
        return self.proc.returncode

    @contextlib.contextmanager
    def running(self) -> Iterator[pb.GetModelInfoResponse]:
        try:
            yield self.start()
        finally:
            self.stop()


def reach(server: Endpoint, protocol: str, workload: Workload, model: str = "") -> Transport:
    """The transport to `server` over `protocol`, with a gRPC channel per client where it needs one and the
    gRPC client the run measures with."""
    return transport(
        protocol,
        server.address,
        server.http_url,
        workload,
        model,
        own_channels=server.own_channels,
        grpc_client=server.grpc_client,
    )


class Endpoint(Protocol):
    """What a point is measured against: a server's addresses, its processes and its metrics (Server, and
    the empty server of the paired one-client rounds)."""

    address: str
    http_url: str
    grpc_client: str

    @property
    def own_channels(self) -> bool: ...

    def pids(self) -> list[int]: ...

    def scrape(self) -> Samples: ...


Load = tuple[Transport, int]  # a transport, and how many distinct requests its clients cycle through


class _Window:
    """The measured window: this process's, the server's and the machine's CPU counters read at its start,
    read again by `close()`."""

    def __init__(self, server_pids: Sequence[int]) -> None:
        self.pids = server_pids
        self.cpu0, self.server0, self.machine0 = self_cpu_seconds(), _cpu_seconds(server_pids), machine_cpu()
        self.threads0 = _threads_cpu_seconds(server_pids)
        self.start = time.perf_counter()

    def close(self) -> dict[str, Any]:
        end = time.perf_counter()
        cpu1, server1, machine1 = self_cpu_seconds(), _cpu_seconds(self.pids), machine_cpu()
        threads1, threads0 = _threads_cpu_seconds(self.pids), self.threads0
        return {
            "window": (self.start, end),
            "client_cpu_s": cpu1 - self.cpu0,
            "server_cpu_s": server1 - self.server0 if self.server0 is not None and server1 is not None else None,
            "server_threads_cpu_s": (
                {role: t - threads0.get(role, 0.0) for role, t in threads1.items()} if threads0 and threads1 else None
            ),
            "machine": (self.machine0, machine1),
        }


def _group() -> dict[str, Any]:
    """One load's records: (sent, received, tokens) a request; cycles: (a client's next send, time since its
    previous send); refusals by kind."""
    return {"records": [], "cycles": [], "errors": {}, "counter": iter(range(1 << 62))}


def _in_window(group: dict[str, Any], window: tuple[float, float], warm_clients: int) -> dict[str, Any]:
    """A load's requests answered within the window, and its clients' cycles begun in it."""
    t_start, t_end = window
    records = [r for r in group["records"] if t_start <= r[1] <= t_end]
    return {
        "cycles": [c for t, c in group["cycles"] if t_start <= t <= t_end],
        "warm_clients": warm_clients,
        "completed": len(records),
        "tokens": sum(r[2] for r in records),
        "latencies": [(r[1] - r[0]) * 1000 for r in records],
        "errors": group["errors"],
        "all_tokens": sum(r[2] for r in group["records"]),
    }


async def _closed_loop(
    loads: Sequence[Load],
    concurrency: int,
    duration: float,
    warmup_max: float,
    server_pids: Sequence[int],
) -> dict[str, Any]:
    """`concurrency` clients on each load, all at once; measure one window once every client has had a
    response. Each load's records are kept apart (`groups`, in the order of `loads`)."""
    groups = [_group() for _ in loads]
    warmed: set[int] = set()
    all_warm = asyncio.Event()
    stop = False

    async with contextlib.AsyncExitStack() as stack:
        for link, _ in loads:
            await stack.enter_async_context(link)

        async def client(g: int, k: int) -> None:
            send = loads[g][0].client()
            n_requests, group = loads[g][1], groups[g]
            previous = None
            while not stop:
                i = next(group["counter"]) % n_requests
                t0 = time.perf_counter()
                if previous is not None:
                    group["cycles"].append((t0, t0 - previous))
                previous = t0
                try:
                    tokens = await send(i)
                except CallFailed as e:
                    group["errors"][e.key] = group["errors"].get(e.key, 0) + 1
                    await asyncio.sleep(0.01)  # a refusal (queue full) must not turn into a busy loop
                    continue
                group["records"].append((t0, time.perf_counter(), tokens))
                if k not in warmed:
                    warmed.add(k)
                    if len(warmed) == concurrency * len(loads):
                        all_warm.set()

        tasks = [
            asyncio.create_task(client(g, g * concurrency + k)) for g in range(len(loads)) for k in range(concurrency)
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_warm.wait(), timeout=warmup_max)
        window = _Window(server_pids)
        await asyncio.sleep(duration)
        raw = window.close()
        stop = True
        # Let in-flight requests finish, so the next point starts on an idle server.
        _, pending = await asyncio.wait(tasks, timeout=120)
        for t in pending:
            t.cancel()

    def warm(g: int) -> int:
        return len(warmed & set(range(g * concurrency, (g + 1) * concurrency)))

    return raw | {"groups": [_in_window(group, raw["window"], warm(g)) for g, group in enumerate(groups)]}


def _lone_sync(
    client: GrpcSyncClient, n_requests: int, duration: float, warmup_max: float, server_pids: Sequence[int]
) -> dict[str, Any]:
    """One client on a synchronous stub, a closed loop in this thread: `_closed_loop`'s measurement of one
    client, the window opening once it has had an answer."""
    group = _group()
    window: _Window | None = None
    warmup_end = time.perf_counter() + warmup_max
    previous = None
    while True:
        t0 = time.perf_counter()
        if window is None and (group["records"] or t0 >= warmup_end):
            window = _Window(server_pids)
        elif window is not None and t0 >= window.start + duration:
            break
        if previous is not None:
            group["cycles"].append((t0, t0 - previous))
        previous = t0
        try:
            tokens = client.send(next(group["counter"]) % n_requests)
        except CallFailed as e:
            group["errors"][e.key] = group["errors"].get(e.key, 0) + 1
            time.sleep(0.01)
            continue
        group["records"].append((t0, time.perf_counter(), tokens))
    raw = window.close()
    return raw | {"groups": [_in_window(group, raw["window"], int(bool(group["records"])))]}


def _cpu_seconds(pids: Sequence[int]) -> float | None:
    """The processes' CPU seconds together (None where /proc cannot say)."""
    each = [process_cpu_seconds(pid) for pid in pids]
    return None if None in each else sum(t for t in each if t is not None)


def _threads_cpu_seconds(pids: Sequence[int]) -> dict[str, float] | None:
    """The processes' CPU seconds by thread role, added up over the processes."""
    roles: dict[str, float] = {}
    for pid in pids:
        each = thread_cpu_seconds(pid)
        if each is None:
            return None
        for role, t in each.items():
            roles[role] = roles.get(role, 0.0) + t
    return roles


def _throughput(group: dict[str, Any], concurrency: int, seconds: float) -> dict[str, Any]:
    """Throughput and latency of one load's clients over the window."""
    # Little's law for a closed loop: each client sends once per cycle (its request's latency plus its
    # own time between requests), so the clients together send concurrency / mean cycle requests a
    # second. Unlike a count of completions in the window it does not jump with the bursts of a batch.
    cycles = group["cycles"]
    seq_per_s = concurrency / (sum(cycles) / len(cycles)) if cycles else group["completed"] / seconds
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "completed": group["completed"],
        "seq_per_s": seq_per_s,
        "tok_per_s": seq_per_s * group["tokens"] / group["completed"] if group["completed"] else 0.0,
        # Completions counted in the window: batches complete in bursts, so this count moves by a whole
        # batch with the window's phase (a 16-request burst is 5% of an 8 s point at 40 seq/s).
        "seq_per_s_counted": group["completed"] / seconds,
        "latency_ms": latency_summary(group["latencies"]),
        "errors": group["errors"],
        "warm_clients": group["warm_clients"],
    }


def _batches(before: Samples, after: Samples, all_tokens: int, **labels: str) -> dict[str, Any]:
    """What the batcher did over a run (of the model `labels` name, or all), from its counters."""

    def delta(name: str) -> float:
        return after.get(name, 0.0, **labels) - before.get(name, 0.0, **labels)

    batches, padded = delta("mhaserve_batch_size_count"), delta("mhaserve_batch_tokens_sum")
    return {
        "batches": batches,
        "mean_batch_size": delta("mhaserve_batch_size_sum") / batches if batches else None,
        # Token-weighted: the share of the tokens the model computed that were padding.
        "padding_fraction": max(0.0, 1 - all_tokens / padded) if padded else None,
    }


def _cpu(raw: dict[str, Any], seconds: float, completed: int) -> dict[str, Any]:
    """CPU in cores (1.0 = one core busy for the whole window), measured over the window."""
    machine = busy_cores(*raw["machine"])
    server_cores = raw["server_cpu_s"] / seconds if raw["server_cpu_s"] is not None else None
    client_cores = raw["client_cpu_s"] / seconds
    return {
        "client_cpu_cores": client_cores,
        # The load generator's cost per request, to compare transports: it must stay far below the server's.
        "client_cpu_ms_per_request": raw["client_cpu_s"] * 1000 / completed if completed else None,
        "server_cpu_cores": server_cores,
        "server_cpu_ms_per_request": (
            raw["server_cpu_s"] * 1000 / completed if completed and raw["server_cpu_s"] is not None else None
        ),
        # Where the server's CPU went, per request, by thread (quiet.thread_cpu_seconds): the event loop
        # (gRPC's Python layer, HTTP, the pipeline), the inference thread (ONNX Runtime's calling thread),
        # tokenize, gRPC's core threads, and other (ONNX Runtime's and the tokenizer's pools).
        "server_threads_ms_per_request": (
            {role: t * 1000 / completed for role, t in sorted(raw["server_threads_cpu_s"].items())}
            if raw.get("server_threads_cpu_s") and completed
            else None
        ),
        "machine_cpu_cores": machine,
        "other_cpu_cores": (
            None if machine is None or server_cores is None else max(0.0, machine - server_cores - client_cores)
        ),
        "cores": os.cpu_count() or 1,
    }


def _measure(server: Endpoint, closed_loop: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Samples, Samples]:
    """The closed loop, with the server's metrics scraped around the whole run, warm-up included: padding
    and batch sizes are properties of the load, steady from the first batches."""
    before = after = Samples([])
    with contextlib.suppress(OSError):
        before = server.scrape()
    raw = closed_loop()
    with contextlib.suppress(OSError):
        after = server.scrape()
    return raw, before, after


def run_point(
    server: Endpoint,
    workload: Workload,
    concurrency: int,
    *,
    duration: float,
    warmup_max: float,
    protocol: str = "grpc",
) -> dict[str, Any]:
    """One point of the sweep: throughput, latency, padding and CPU shares of `concurrency` clients (one,
    for `grpc-sync`: GrpcSyncClient)."""
    if protocol == GRPC_SYNC:
        if concurrency != 1:
            raise ValueError(f"{GRPC_SYNC} is one client, not {concurrency}")
        with GrpcSyncClient(server.address, workload) as client:
            raw, before, after = _measure(
                server, lambda: _lone_sync(client, len(workload.ids), duration, warmup_max, server.pids())
            )
    else:
        link = reach(server, protocol, workload)
        loads = [(link, len(workload.ids))]
        raw, before, after = _measure(
            server, lambda: asyncio.run(_closed_loop(loads, concurrency, duration, warmup_max, server.pids()))
        )
    seconds = raw["window"][1] - raw["window"][0]
    group = raw["groups"][0]
    return {
        "protocol": protocol,
        **_throughput(group, concurrency, seconds),
        **_batches(before, after, group["all_tokens"]),
        **_cpu(raw, seconds, group["completed"]),
    }


def run_models_point(
    server: Server,
    workloads: dict[str, Workload],
    concurrency: int,
    *,
    duration: float,
    warmup_max: float,
) -> dict[str, Any]:
    """`concurrency` gRPC clients for each model named in `workloads`, all at once, against one server:
    throughput, latency and batches per model (`models`), CPU shares of the whole point."""
    loads = [(reach(server, "grpc", w, model), len(w.ids)) for model, w in workloads.items()]
    raw, before, after = _measure(
        server, lambda: asyncio.run(_closed_loop(loads, concurrency, duration, warmup_max, server.pids()))
    )
    seconds = raw["window"][1] - raw["window"][0]
    models = {
        model: _throughput(group, concurrency, seconds) | _batches(before, after, group["all_tokens"], model=model)
        for model, group in zip(workloads, raw["groups"], strict=True)
    }
    completed = sum(m["completed"] for m in models.values())
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "models": models,
        "seq_per_s": sum(m["seq_per_s"] for m in models.values()),
        **_cpu(raw, seconds, completed),
    }
