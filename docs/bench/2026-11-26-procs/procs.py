"""`mhaserve serve --processes N` under one-text requests: throughput by N, over gRPC and HTTP.

For each N a fresh `mhaserve serve --processes N`; for each client count and protocol, W load processes
(spawned), each with its share of closed-loop clients, every client on its own connection (a gRPC
channel with a local subchannel pool, or one HTTP keep-alive connection), so that the kernel spreads
them over the N processes. `mhaserve bench` cannot do this: its load generator is one process (about
0.3 ms of CPU a request, so about 3,000 requests a second at most) and its gRPC clients share one
channel, which is one connection, which one process accepts.

Reported per point: seq/s (completions in the window), p50/p99 ms, the server's CPU (the supervisor and
its processes, in cores), the load processes' CPU, and the mean batch (summed over every process's
metrics). First, the ceiling as the bench defines it (ONNX Runtime in process on the same graph, best
batch, inputs sorted by length, tokenisation counted), measured by the bench's own code.

    python procs.py --repository models --device cuda --processes 1,2,4,8 --clients 32,128 --out procs.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mhaserve.loadtest.bench.inprocess import measure_onnx
from mhaserve.loadtest.bench.quiet import process_cpu_seconds
from mhaserve.loadtest.bench.transports import HttpConnection, grpc_requests, http_requests
from mhaserve.loadtest.bench.workloads import load_corpus, short
from mhaserve.loadtest.stats import latency_summary
from mhaserve.loadtest.texts import SHORT
from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.testing.loopback import free_port_run, free_ports
from mhaserve.testing.metrics import scrape

HOST = "127.0.0.1"


def _load(protocol: str, target: str, requests: list[Any], clients: int, offset: int, t0: float, t1: float) -> dict:
    """One load process: `clients` closed-loop clients until t1; what completed between t0 and t1."""
    import grpc.aio
    import orjson

    from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
    from mhaserve.service.client import CHANNEL_OPTIONS

    latencies: list[float] = []
    errors: dict[str, int] = {}
    counter = iter(range(offset, 1 << 62))

    async def grpc_client() -> None:
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]  # its own connection
        async with grpc.aio.insecure_channel(target, options=options) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            while time.time() < t1:
                request = requests[next(counter) % len(requests)]
                start = time.time()
                try:
                    await stub.Encode(request, timeout=60)
                except grpc.aio.AioRpcError as e:
                    errors[e.code().name] = errors.get(e.code().name, 0) + 1
                    await asyncio.sleep(0.01)
                    continue
                end = time.time()
                if t0 <= end <= t1:
                    latencies.append((end - start) * 1000)

    async def http_client() -> None:
        connection = HttpConnection(HOST, int(target))
        while time.time() < t1:
            raw = requests[next(counter) % len(requests)]
            start = time.time()
            try:
                status, body = await connection.request(raw)
            except (OSError, asyncio.IncompleteReadError) as e:
                connection.close()
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                continue
            if status != 200 or len(orjson.loads(body)["data"]) != 1:
                errors[f"HTTP {status}"] = errors.get(f"HTTP {status}", 0) + 1
                continue
            end = time.time()
            if t0 <= end <= t1:
                latencies.append((end - start) * 1000)
        connection.close()

    async def main() -> float:
        client = grpc_client if protocol == "grpc" else http_client
        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        await asyncio.sleep(max(0.0, t0 - time.time()))
        cpu0 = _self_cpu()
        await asyncio.sleep(max(0.0, t1 - time.time()))
        cpu1 = _self_cpu()
        await asyncio.gather(*tasks)
        return cpu1 - cpu0

    cpu = asyncio.run(main())
    return {"latencies": latencies, "errors": errors, "cpu_s": cpu}


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _tree(pid: int) -> list[int]:
    """`pid` and its children (the supervisor's server processes), from /proc."""
    found = [pid]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _server_cpu(pid: int) -> float:
    return sum(process_cpu_seconds(p) or 0.0 for p in _tree(pid))


def _batches(ports: list[int]) -> tuple[float, float]:
    total = count = 0.0
    for port in ports:
        s = scrape(port)
        total += s.get("mhaserve_batch_size_sum")
        count += s.get("mhaserve_batch_size_count")
    return total, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repository", default="models")
    ap.add_argument("--model", default="all-minilm-l6-v2")
    ap.add_argument("--graph", default="optimized")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--processes", default="1,2,4,8")
    ap.add_argument("--clients", default="32,128")
    ap.add_argument("--protocols", default="grpc,http")
    ap.add_argument("--load-processes", type=int, default=4)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--ceiling-batches", default="1,128")
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--out", default="procs.json")
    opt = ap.parse_args()

    entry = ModelRepository(Path(opt.repository)).entry(opt.model, graph=opt.graph)
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    workload = short(tokenizer, load_corpus(SHORT), pool=2000)
    result: dict[str, Any] = {"argv": sys.argv, "cpus": os.cpu_count(), "points": []}

    if opt.ceiling_batches:
        spec = {
            "repository": opt.repository, "model": opt.model, "graph": opt.graph, "device": opt.device,
            "threads": None, "min_time": 2.0, "guard": {"retries": 0},
            "batch_sizes": [int(b) for b in opt.ceiling_batches.split(",")],
        }  # fmt: skip
        ceiling = measure_onnx(spec, workload)
        result["ceiling"] = {k: ceiling[k] for k in ("ceiling", "one_at_a_time", "providers")}
        print(f"ceiling {ceiling['ceiling']['seq_per_s']:.0f} seq/s at batch {ceiling['ceiling']['batch_size']}; "
              f"one at a time {ceiling['one_at_a_time']['seq_per_s']:.0f}", flush=True)  # fmt: skip

    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(opt.load_processes, mp_context=spawn) as pool:
        list(pool.map(abs, range(opt.load_processes)))  # start them before anything is timed
        for n in (int(x) for x in opt.processes.split(",")):
            grpc_port, http_port = free_ports(2)
            # The supervisor's port, and process i's own after it. (As run on 2026-11-26, process i served on
            # metrics + i and the script summed those; the supervisor now gathers them all on its port.)
            metrics = free_port_run(n + 1, avoid=(grpc_port, http_port))
            metrics_ports = [metrics]
            log = Path(opt.out).with_suffix(f".serve{n}.log")
            args = [
                sys.executable, "-m", "mhaserve.cli", "serve", "--repository", opt.repository, "--model", opt.model,
                "--graph", opt.graph, "--device", opt.device, "--processes", str(n), "--port", str(grpc_port),
                "--http-port", str(http_port), "--metrics-port", str(metrics), "--grace-period", "5",
                *opt.server_arg,
            ]  # fmt: skip
            with log.open("w") as out:
                server = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
            deadline = time.time() + 240
            # Ready: the supervisor's line once every process listens, or a lone server's own once it has
            # warmed up (it listens before, refusing calls). As run on 2026-11-26 the script waited for n lines of
            # "serving ... version", one a process then; each now logs two, so on 2026-12-04 the first point after
            # a start began before half the processes listened and its connections went to the others.
            ready = rf"all {n} processes are serving" if n > 1 else r"service\.server .*serving \S+ version"
            while not re.search(ready, log.read_text()):
                if server.poll() is not None or time.time() > deadline:
                    print(log.read_text()[-3000:], flush=True)
                    server.kill()
                    return 1
                time.sleep(0.2)
            for clients in (int(x) for x in opt.clients.split(",")):
                for protocol in opt.protocols.split(","):
                    if protocol == "grpc":
                        target, requests = f"{HOST}:{grpc_port}", grpc_requests(workload)
                    else:
                        target, requests = str(http_port), http_requests(workload, f"{HOST}:{http_port}", "float")
                    w = opt.load_processes
                    shares = [clients // w + (1 if i < clients % w else 0) for i in range(w)]
                    t0 = time.time() + 1.0 + opt.warmup  # spawned loads set up within the first second
                    t1 = t0 + opt.duration
                    futures = [
                        pool.submit(_load, protocol, target, requests, c, i * 997, t0, t1)
                        for i, c in enumerate(shares)
                        if c
                    ]
                    time.sleep(max(0.0, t0 - time.time()))
                    cpu0, b0 = _server_cpu(server.pid), _batches(metrics_ports)
                    time.sleep(max(0.0, t1 - time.time()))
                    cpu1, b1 = _server_cpu(server.pid), _batches(metrics_ports)
                    loads = [f.result(timeout=180) for f in futures]
                    latencies = [x for r in loads for x in r["latencies"]]
                    errors: dict[str, int] = {}
                    for r in loads:
                        for k, v in r["errors"].items():
                            errors[k] = errors.get(k, 0) + v
                    point = {
                        "processes": n, "clients": clients, "protocol": protocol,
                        "seq_per_s": len(latencies) / opt.duration, "latency_ms": latency_summary(latencies),
                        "server_cores": (cpu1 - cpu0) / opt.duration,
                        "load_cores": sum(r["cpu_s"] for r in loads) / opt.duration,
                        "mean_batch": (b1[0] - b0[0]) / (b1[1] - b0[1]) if b1[1] > b0[1] else None,
                        "errors": errors,
                    }  # fmt: skip
                    if "ceiling" in result:
                        point["of_ceiling"] = point["seq_per_s"] / result["ceiling"]["ceiling"]["seq_per_s"]
                    result["points"].append(point)
                    lat = point["latency_ms"]
                    print(
                        f"processes {n} {protocol:4} clients {clients:3}: {point['seq_per_s']:8.0f} seq/s "
                        f"p50 {lat['p50']:6.1f} p99 {lat['p99']:6.1f} ms  server {point['server_cores']:5.2f} cores "
                        f"load {point['load_cores']:5.2f}  batch {point['mean_batch'] or 0:5.1f}  errors {errors}",
                        flush=True,
                    )
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    Path(opt.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
