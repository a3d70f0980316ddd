"""The server's memory under load: resident and peak memory after warm-up and after many requests, per graph.

A server that serves for weeks must not grow: each graph asked for (`--graphs`; by default each CPU graph
the entry has: fp32, the fused `optimized` and `optimized-cpu`, and `int8`, where the manifest lists them and
`serve --graph` takes them) is served by a fresh `mhaserve serve`, warmed up, then sent N requests
by a closed loop of clients; its /proc status is read at start-up, after the warm-up and at ten points on
the way to N. Growth is counted from the warm-up on: what a server takes while it first meets its shapes
(ONNX Runtime's arenas, the allocator's pools) is its size, not a leak.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from mhaserve.loadtest.bench.client import BenchError, Server, reach
from mhaserve.loadtest.bench.transports import CallFailed, Send
from mhaserve.loadtest.bench.workloads import Workload
from mhaserve.loadtest.stats import slope
from mhaserve.runtime import manifest as mf
from mhaserve.runtime.progress import Progress
from mhaserve.runtime.repository import ModelEntry
from mhaserve.testing.process import Memory

# The CPU graphs whose memory is measured, in this order; fp16 is for CUDA, whose memory RSS does not show.
GRAPHS = mf.CPU_GRAPHS
# Growth after warm-up above this is reported as growth (a leak to look for), not noise.
BOUND_MIB = 16.0
CHECKPOINTS = 10
# Workloads the memory run prefers: the short texts most users send, then the widest range of shapes.
PREFERRED_WORKLOADS = ("short", "mixed", "fixed")


def graphs_to_measure(
    requested: Sequence[str] | None, in_manifest: Iterable[str], servable: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """(the graphs to measure, {graph: why it is not} for the others asked for). Asked for none: the CPU graphs
    the entry has, in GRAPHS' order. A graph is measured when the entry has it and the server can serve it."""
    have = list(in_manifest)
    asked = list(requested) if requested else [g for g in GRAPHS if g in have]
    measured, skipped = [], {}
    for g in asked:
        if g not in have:
            skipped[g] = f"the entry has no {g} graph (it has {', '.join(have)})"
        elif g not in servable:
            skipped[g] = f"the entry has it, but this server cannot serve it (`mhaserve serve --graph` has no {g})"
        else:
            measured.append(g)
    return measured, skipped


def pick_workload(names: Iterable[str]) -> str:
    """The workload the memory run sends, out of those the bench built."""
    names = list(names)
    return next((w for w in PREFERRED_WORKLOADS if w in names), names[0])


def warmup_requests(requests: int, pool: int) -> int:
    """Requests sent before the first reading: every input of the workload once, and a twentieth of the run."""
    return max(pool, requests // 20)


async def _load(
    server: Server,
    workload: Workload,
    marks: Sequence[int],
    clients: int,
    read: Callable[[], Memory],
    told: Callable[[int, Memory], None] | None,
) -> tuple[list[Memory], dict[str, int]]:
    """Send requests up to each mark in turn (a running count), reading the memory at each (and telling `told`
    of it); the readings and the failures by kind."""
    errors: dict[str, int] = {}
    readings = []
    sent = 0

    async def client(send: Send, todo: Iterator[int]) -> None:
        for i in todo:  # shared by the clients: each request is sent by whichever client is free
            try:
                await send(i % len(workload.ids))
            except CallFailed as e:
                errors[e.key] = errors.get(e.key, 0) + 1

    link = reach(server, "grpc", workload)
    async with link:
        sends = [link.client() for _ in range(clients)]
        for mark in marks:
            todo = iter(range(sent, mark))
            await asyncio.gather(*(client(send, todo) for send in sends))
            sent = mark
            readings.append(read())
            if told is not None:
                told(mark, readings[-1])
    return readings, errors


def measure(
    server: Server,
    workload: Workload,
    *,
    requests: int,
    clients: int,
    checkpoints: int = CHECKPOINTS,
    told: Callable[[int, Memory], None] | None = None,
) -> dict[str, Any]:
    """The server's memory at start-up (just SERVING), after the warm-up, and every `requests / checkpoints`
    requests after it; `requests` counts from the end of the warm-up. `told(requests so far, reading)` hears
    of each reading as it is taken: a run of 100,000 requests takes many minutes."""
    warmup = warmup_requests(requests, len(workload.ids))
    marks = [warmup] + [warmup + requests * k // checkpoints for k in range(1, checkpoints + 1)]
    start = server.memory()
    t0 = time.perf_counter()

    def tell(mark: int, reading: Memory) -> None:
        if told is not None:
            told(mark - warmup, reading)

    readings, errors = asyncio.run(_load(server, workload, marks, clients, server.memory, tell))
    return {
        "seconds": time.perf_counter() - t0,
        "workload": workload.name,
        "clients": clients,
        "warmup_requests": warmup,
        "requests": requests,
        "errors": errors,
        "start": dataclasses.asdict(start),
        "samples": [{"requests": m - warmup, **dataclasses.asdict(r)} for m, r in zip(marks, readings, strict=True)],
    }


def _tell(progress: Progress, graph: str, requests: int, reading: Memory) -> None:
    progress.say(f"  {graph}: {requests:,} requests, RSS {reading.rss_kib / 1024:.1f} MiB")


def measure_graphs(
    entry: ModelEntry,
    graphs: Sequence[str],
    make_server: Callable[[str], Server],
    workload: Workload,
    *,
    requests: int,
    clients: int,
    progress: Progress,
) -> dict[str, dict[str, Any]]:
    """Each graph served in turn by a fresh server (`make_server(graph)`), its memory measured and summed up."""
    runs = {}
    for graph in graphs:
        server = make_server(graph)
        with (
            progress.step(
                f"server memory, {graph} graph: {requests:,} requests of {workload.name}, {clients} clients"
            ) as note,
            server.running() as info,
        ):
            if info.graph != graph:
                raise BenchError(f"asked the server for the {graph} graph, it serves {info.graph}")
            run = measure(
                server,
                workload,
                requests=requests,
                clients=clients,
                told=functools.partial(_tell, progress, graph),
            )
            run["summary"] = growth(run)
            run["file_mib"] = (entry.directory / entry.manifest.graphs[graph].file).stat().st_size / 2**20
            run["provider"] = info.execution_provider
            runs[graph] = run
            s = run["summary"]
            note["result"] = (
                f"{s['warm']['rss_kib'] / 1024:.0f} MiB after warm-up, {s['end']['rss_kib'] / 1024:.0f} MiB "
                f"after {s['end']['requests']:,} requests ({s['growth_kib'] / 1024:+.1f} MiB; "
                f"{run['seconds']:.0f} s)" + (f", errors {run['errors']}" if run["errors"] else "")
            )
    return runs


def growth(run: dict[str, Any], bound_mib: float = BOUND_MIB) -> dict[str, Any]:
    """What a run's readings say: memory after the warm-up and at the end, the growth between them (resident
    and peak) and over the second half alone, the resident memory's slope over the run, and whether the growth
    stayed within `bound_mib`."""
    samples = run["samples"]
    warm, half, end = samples[0], samples[len(samples) // 2], samples[-1]
    grew = end["rss_kib"] - warm["rss_kib"]
    per_10k = slope([s["requests"] / 10_000 for s in samples], [float(s["rss_kib"]) for s in samples])
    return {
        "warm": warm,
        "end": end,
        "growth_kib": grew,
        # A leak grows as fast in the second half as in the first; arenas meeting new shapes level off.
        "second_half_growth_kib": end["rss_kib"] - half["rss_kib"],
        "peak_growth_kib": end["peak_kib"] - warm["peak_kib"],
        "slope_kib_per_10k": per_10k,
        "bound_mib": bound_mib,
        "steady": grew <= bound_mib * 1024,
    }


def result(batching: str, runs: dict[str, dict[str, Any]], skipped: dict[str, str]) -> dict[str, Any]:
    """The report's `memory`: each graph's run, the graphs skipped and why, and the verdict."""
    return {"batching": batching, "graphs": runs, "skipped": skipped, "verdict": verdict(runs)}


def verdict(graphs: dict[str, dict[str, Any]]) -> str:
    """One line over every graph measured."""
    if not graphs:
        return "no graph was measured"
    grew = {g: r["summary"] for g, r in graphs.items() if not r["summary"]["steady"]}
    bound = next(iter(graphs.values()))["summary"]["bound_mib"]
    if not grew:
        worst = max(r["summary"]["growth_kib"] for r in graphs.values())
        return (
            f"no growth: after warm-up, resident memory moved by at most {worst / 1024:+.1f} MiB on any graph "
            f"(bound {bound:g} MiB)"
        )
    return (
        "GROWTH: "
        + "; ".join(
            f"{g} grew {s['growth_kib'] / 1024:+.1f} MiB over {s['end']['requests']:,} requests "
            f"({s['slope_kib_per_10k']:+.0f} KiB per 10k requests)"
            for g, s in grew.items()
        )
        + f", above the {bound:g} MiB bound: look for a leak"
    )
