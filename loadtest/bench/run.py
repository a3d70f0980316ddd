"""`mhaserve bench`: the server against its ceiling, side by side, in one run on one machine and model.

1. the ceiling: ONNX Runtime in-process over a sweep of batch sizes, the best of them;
2. ONNX Runtime in-process, one request at a time;
3. PyTorch eager in-process (what a user without a server would run);
4. `mhaserve serve` over gRPC, for each batching policy, at a sweep of concurrent clients (the policies'
   servers take turns at each point);
5. the same server over HTTP (OpenAI `POST /v1/embeddings`) beside gRPC, on the text workloads, with the
   length policy's server, at the same client counts and in turn with its gRPC points; and at one client
   from grpcio's synchronous stub too (the client `mhaserve encode` uses);
each for the fixed-length, the mixed-length and the short-text workload; then
6. queries at random times beside indexing clients' bulk requests, on the short texts over HTTP (beside.py),
   and the queries alone replayed in process (inprocess.replay);
7. the server's memory, each CPU graph of the entry served in turn (memory.py).
Outputs: report.md, report.json, throughput.png, latency.png and the servers' logs, in
results/bench-<timestamp>/ or --output. `--models` measures several models in one server instead (models.py),
`--memory-only` the server's memory alone (memory_only.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import functools
import itertools
import json
import math
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from mhaserve.loadtest.bench import beside, entries, memory, memory_only, models, options, report
from mhaserve.loadtest.bench.client import BenchError, Endpoint, Server, run_point
from mhaserve.loadtest.bench.empty import EmptyServer
from mhaserve.loadtest.bench.inprocess import measure_in_child
from mhaserve.loadtest.bench.options import GRPC_SYNC, PROTOCOLS
from mhaserve.loadtest.bench.quiet import Guard
from mhaserve.loadtest.bench.workloads import Workload
from mhaserve.loadtest.machine import load
from mhaserve.loadtest.machine import machine as describe_machine
from mhaserve.runtime.progress import Progress
from mhaserve.runtime.repository import GRAPHS


def _alone(spec: dict[str, Any], workload: Workload, batch_size: int) -> dict[str, Any]:
    """The in-process spec for ONNX Runtime alone on `workload` at `batch_size`: no PyTorch, no replay of the
    server's batches, no batches side by side."""
    return dict(
        spec,
        torch=False,
        served=None,
        side_by_side=None,
        workloads=[workload.to_dict()],
        batch_sizes_by_workload={workload.name: [batch_size]},
    )


def _paired(
    opt: dict[str, Any],
    spec: dict[str, Any],
    server: Server,
    workload: Workload,
    inprocess: dict[str, Any],
    guard: Guard,
    progress: Progress,
) -> dict[str, Any]:
    """Ceiling and server at the headline client count, in turns: each ratio from measurements minutes apart."""
    clients = report.HEADLINE_CLIENTS
    best = inprocess["fixed"]["ceiling"]["batch_size"]
    one = _alone(spec, workload, best)
    pairs = []
    for k in range(opt["paired"]):
        with progress.step(
            f"paired {k + 1}/{opt['paired']}: ceiling, then the server at {clients} clients", reports=True
        ) as note:
            ceiling = measure_in_child(one)["fixed"]["ceiling"]
            point = guard.measure(
                functools.partial(
                    run_point, server, workload, clients, duration=opt["duration"], warmup_max=3 * opt["duration"]
                ),
                progress.say,
            )
            pairs.append(
                {
                    "ceiling_seq_per_s": ceiling["seq_per_s"],
                    "server_seq_per_s": point["seq_per_s"],
                    "ratio": point["seq_per_s"] / ceiling["seq_per_s"],
                    "ceiling_other_cpu_cores": ceiling.get("other_cpu_cores"),
                    "server_other_cpu_cores": point.get("other_cpu_cores"),
                    "disturbed": bool(ceiling.get("disturbed") or point.get("disturbed")),
                }
            )
            note["result"] = f"{ceiling['seq_per_s']:.1f} vs {point['seq_per_s']:.1f} seq/s: {pairs[-1]['ratio']:.2f}"
    return {
        "batching": server.batching,
        "clients": clients,
        "batch_size": best,
        "pairs": pairs,
        "median_ratio": statistics.median(p["ratio"] for p in pairs),
    }


def _rotated_rounds(
    n: int,
    turns: list[str],
    measure: Callable[[str], dict[str, dict[str, Any]]],
    summary: Callable[[dict[str, dict[str, Any]], list[str]], dict[str, Any]],
    describe: Callable[[dict[str, Any]], str],
    step: str,
    progress: Progress,
) -> list[dict[str, Any]]:
    """`n` rounds of `turns`, each starting one turn later than the last, so that a drift of the machine
    within a round falls on each side in turn: `measure(turn)` gives a turn's named figures, `summary(got,
    order)` the round's record, `describe(record)` its progress line; `step` is the step's name, formatted
    with "k/n" and the order."""
    rounds = []
    for k in range(n):
        order = turns[k % len(turns) :] + turns[: k % len(turns)]
        with progress.step(step.format(f"{k + 1}/{n}", ", ".join(order)), reports=True) as note:
            got: dict[str, dict[str, Any]] = {}
            for turn in order:
                got |= measure(turn)
            rounds.append(summary(got, order))
            note["result"] = describe(rounds[-1])
    return rounds


def _paired_short(
    opt: dict[str, Any],
    spec: dict[str, Any],
    server: Server,
    workload: Workload,
    inprocess: dict[str, Any],
    http: str | None,
    guard: Guard,
    progress: Progress,
) -> dict[str, Any]:
    """The short workload's gap split, measured in turns at the headline client count: the ceiling, the
    server's own batches and, when the sweep measured them, batches side by side as its workers compute them
    (at their best batch size) in process (one child), the server over gRPC and over `http` (paired_http). Each
    round starts one turn later, so that a drift of the machine within a round falls on each side in turn;
    the medians of the rounds' ratios are what a single sweep point cannot give on a shared machine."""
    clients = report.HEADLINE_CLIENTS
    best = inprocess["short"]["ceiling"]["batch_size"]
    side = inprocess["short"].get("side_by_side")
    one = dict(
        spec,
        torch=False,
        side_by_side=spec.get("side_by_side") if side else None,
        side_by_side_batches=[side["batch_size"]] if side else None,
        workloads=[workload.to_dict()],
        batch_sizes_by_workload={"short": [best]},
        # The server's batches for the clients these rounds serve, not the sweep's count nearest them (a sweep
        # of 1 and 4 clients compared 32 clients' throughput with 4 clients' batches).
        served=dict(spec["served"], clients=clients) if spec.get("served") else None,
    )

    def measure(turn: str) -> dict[str, dict[str, Any]]:
        if turn != report.IN_PROCESS:
            return {turn: _measured_point(opt, server, workload, clients, turn, guard, progress)}
        measured = measure_in_child(one)["short"]
        names = {"ceiling": "ceiling", "served_batching": "served", "side_by_side": "side"}
        return {name: measured[key] for key, name in names.items() if key in measured}

    rounds = _rotated_rounds(
        opt["paired"],
        [report.IN_PROCESS, "grpc", *([http] if http else [])],
        measure,
        _paired_round,
        lambda r: ", ".join(f"{name} {v:.2f}" for name, v in r["ratios"].items()),
        f"paired short {{}}: {{}} at {clients} clients",
        progress,
    )
    names = list(rounds[0]["ratios"])
    return {
        "workload": "short",
        "batching": server.batching,
        "clients": clients,
        "batch_size": best,
        "rounds": rounds,
        "median": {name: statistics.median(r["ratios"][name] for r in rounds) for name in names},
    }


def _paired_lone(
    opt: dict[str, Any],
    spec: dict[str, Any],
    server: Server,
    workload: Workload,
    protocols: list[str],
    dimensions: int,
    delay_ms: float,
    empty_log: Path,
    guard: Guard,
    progress: Progress,
) -> dict[str, Any]:
    """One client's p50 against ONNX Runtime's on one text at a time in process (one child, tokenising
    counted), in turns with one client of each of `protocols` and, for gRPC and HTTP, one client of the same
    protocol on an empty server (empty.py: the protocol stack alone, answering each call `delay_ms` after it
    arrives, idle meanwhile as the server is while the model computes; whole milliseconds, as epoll waits),
    each round starting one turn later: issue 18's one-client gap as medians of rounds, where the sweep's
    single point compares figures minutes apart, and the floor under it measured in the same minutes."""
    one = _alone(spec, workload, 1)
    # The empty server answers float JSON whatever the request asks: a floor for HTTP's float answers only.
    floors = [p for p in ("grpc", "http") if p in protocols]
    front = options.server_front(opt["server_arg"])  # the served front's floor, not another's
    empty = EmptyServer(dimensions, delay_ms / 1000, empty_log, front)
    empty.grpc_client = opt["grpc_client"]

    def measure(turn: str) -> dict[str, dict[str, Any]]:
        if turn == report.IN_PROCESS:
            return {turn: measure_in_child(one)[workload.name]["one_at_a_time"]}
        if turn.startswith(report.EMPTY):
            return {turn: _measured_point(opt, empty, workload, 1, turn.removeprefix(report.EMPTY), guard, progress)}
        return {turn: _measured_point(opt, server, workload, 1, turn, guard, progress)}

    def summary(got: dict[str, dict[str, Any]], order: list[str]) -> dict[str, Any]:
        p50 = {turn: r["latency_ms"]["p50"] for turn, r in got.items()}
        gap = {p: p50[p] - p50[report.IN_PROCESS] for p in protocols}
        # The empty server's p50 less the time it idles on each call is its whole gap: it has no model.
        floor = {p: p50[report.EMPTY + p] - delay_ms for p in floors}
        return {
            "order": order,
            "p50_ms": p50,
            "gap_ms": gap,
            "floor_ms": floor,
            "above_floor_ms": {p: gap[p] - floor[p] for p in floors},
            "server_cpu_ms_per_request": {
                turn: r["server_cpu_ms_per_request"]
                for turn, r in got.items()
                if r.get("server_cpu_ms_per_request") is not None
            },
            "other_cpu_cores": {turn: r.get("other_cpu_cores") for turn, r in got.items()},
            "disturbed": any(r.get("disturbed") for r in got.values()),
        }

    with empty.running():
        rounds = _rotated_rounds(
            opt["paired"],
            [report.IN_PROCESS, *protocols, *(report.EMPTY + p for p in floors)],
            measure,
            summary,
            lambda r: (
                f"in process {r['p50_ms']['in process']:.2f} ms; "
                + ", ".join(
                    f"{p} {gap:+.2f}" + (f" (empty server {r['floor_ms'][p]:.2f})" if p in r["floor_ms"] else "")
                    for p, gap in r["gap_ms"].items()
                )
            ),
            f"paired one client {{}}: {{}}, {workload.name} workload",
            progress,
        )

    def median(key: str) -> dict[str, float]:
        return {name: statistics.median(r[key][name] for r in rounds) for name in rounds[0][key]}

    return {
        "workload": workload.name,
        "batching": server.batching,
        "rounds": rounds,
        "median_p50_ms": median("p50_ms"),
        "median_gap_ms": median("gap_ms"),
        "empty_server_delay_ms": delay_ms,
        "empty_server_front": front,
        "median_floor_ms": median("floor_ms"),
        "median_above_floor_ms": median("above_floor_ms"),
        "median_server_cpu_ms_per_request": median("server_cpu_ms_per_request"),
    }


def _beside_bulk(
    opt: dict[str, Any], spec: dict[str, Any], server: Server, workload: Workload, progress: Progress
) -> dict[str, Any]:
    """Queries beside each count of bulk clients (beside.py), in rounds (--paired, at least one) that each measure
    every count in turn, the next round starting one turn later; the medians of the rounds by count. With the
    queries alone (0) among the counts, a turn replays the same queries in process (one child, ONNX Runtime on
    every core, tokenising counted): the reference for a query that meets an idle server."""
    counts = [str(n) for n in opt["beside_bulk"]]
    turns = [*counts, report.IN_PROCESS] if "0" in counts else counts
    calls = itertools.count()
    alone = _alone(spec, workload, 1)

    def measure(turn: str) -> dict[str, dict[str, Any]]:
        # Every turn of a round is sent the same queries (the replay too), each round others: the same in every run.
        seed = opt["seed"] + next(calls) // len(turns)
        if turn == report.IN_PROCESS:
            sporadic = {"seconds": opt["duration"], "rate": opt["query_rate"], "seed": seed}
            return {turn: measure_in_child(dict(alone, sporadic=sporadic))[workload.name]["sporadic"]}
        bulk, rate = int(turn), opt["query_rate"]
        return {turn: asyncio.run(beside.measure(server.http_url, workload.texts, bulk, opt["duration"], rate, seed))}

    def describe(r: dict[str, Any]) -> str:
        return ", ".join(
            (n if n == report.IN_PROCESS else f"{n} bulk")
            + f": queries p50 {m['latency_ms']['p50']:.1f} ms"
            + (f", bulk {m['bulk_texts_per_s']:.0f} texts/s" if m.get("bulk_texts_per_s") is not None else "")
            + (f", errors {sum(m['errors'].values())}" if m.get("errors") else "")
            for n, m in r["mixes"].items()
        )

    rounds = _rotated_rounds(
        max(1, opt["paired"]),
        turns,
        measure,
        lambda got, order: {"order": order, "mixes": got},
        describe,
        "queries beside bulk clients {}, in turn: {}",
        progress,
    )

    def median(n: str, figure: str) -> float:
        return statistics.median(r["mixes"][n]["latency_ms"][figure] for r in rounds)

    by_count = {}
    for n in counts:
        mixes = [r["mixes"][n] for r in rounds]
        bulk = [m["bulk_texts_per_s"] for m in mixes if m["bulk_texts_per_s"] is not None]
        errors = sum((Counter(m["errors"]) for m in mixes), Counter[str]())
        failures = [f for m in mixes if (f := beside.failure(m)) is not None]
        by_count[n] = {
            "latency_ms": {figure: median(n, figure) for figure in ("p50", "p95", "p99", "mean")},
            "bulk_texts_per_s": statistics.median(bulk) if bulk else None,
            "queries": sum(m["queries"] for m in mixes),
            "answered": sum(m["answered"] for m in mixes),
            "errors": dict(errors),
            # A round without its bulk load, or without an answered query, is no result: its medians are not
            # quoted, and the run fails (report.failures).
            "failed": f"{failures[0]} in {len(failures)} of {len(mixes)} round(s)" if failures else None,
        }
    in_process = None
    if report.IN_PROCESS in turns:
        replays = [r["mixes"][report.IN_PROCESS] for r in rounds]
        in_process = {
            "latency_ms": {figure: median(report.IN_PROCESS, figure) for figure in ("p50", "p95", "p99", "mean")},
            "queries": sum(m["queries"] for m in replays),
        }
    return {
        "workload": workload.name,
        "batching": server.batching,
        "route": "POST /v1/embeddings",
        "encoding_format": beside.ENCODING,
        "bulk_inputs": beside.BULK_INPUTS,
        "query_rate": opt["query_rate"],
        "seconds": opt["duration"],
        "rounds": rounds,
        "median": by_count,
        "in_process": in_process,
    }


def paired_http(protocols: Sequence[str]) -> str | None:
    """The HTTP protocol the paired rounds measure beside gRPC: the float one where the sweep measured it, else
    the base64 one (--protocols grpc,http-base64 once had no HTTP in its rounds), else none."""
    return next((p for p in ("http", "http-base64") if p in protocols), None)


def _paired_round(got: dict[str, dict[str, Any]], turns: list[str]) -> dict[str, Any]:
    """One round's figures and their ratios: each protocol to the ceiling, to the server's own batches and to
    the batches side by side, and those in-process figures to the ceiling."""
    ceiling = got["ceiling"]["seq_per_s"]
    protocols = [p for p in PROTOCOLS if p in got]
    names = ("served", "side", *protocols)
    seq = {"ceiling": ceiling} | {name: got[name]["seq_per_s"] for name in names if name in got}
    ratios = {f"{name}/ceiling": seq[name] / ceiling for name in ("served", "side") if name in seq}
    for protocol in protocols:
        ratios[f"{protocol}/ceiling"] = seq[protocol] / ceiling
        for reference in ("served", "side"):
            if reference in seq:
                ratios[f"{protocol}/{reference}"] = seq[protocol] / seq[reference]
    return {
        "order": turns,
        "seq_per_s": seq,
        "ratios": ratios,
        "other_cpu_cores": {name: r.get("other_cpu_cores") for name, r in got.items()},
        "disturbed": any(r.get("disturbed") for r in got.values()),
        **({"served_clients": got["served"].get("clients")} if "served" in got else {}),
    }


def _measured_point(
    opt: dict[str, Any],
    server: Endpoint,
    workload: Workload,
    clients: int,
    protocol: str,
    guard: Guard,
    progress: Progress,
) -> dict[str, Any]:
    """The server at `clients` closed-loop clients over `protocol`, measured again while other work disturbs it."""
    return guard.measure(
        functools.partial(
            run_point,
            server,
            workload,
            clients,
            duration=opt["duration"],
            warmup_max=max(5.0, 3 * opt["duration"]),
            protocol=protocol,
        ),
        progress.say,
    )


def _point(
    opt: dict[str, Any],
    server: Server,
    workload: Workload,
    clients: int,
    protocol: str,
    ceiling: float,
    guard: Guard,
    progress: Progress,
) -> dict[str, Any]:
    """One server point of the sweep, measured again while other work disturbs it."""
    with progress.step(f"server {server.batching:7} {protocol:11} {workload.name:5} {clients:3} clients") as note:
        point = _measured_point(opt, server, workload, clients, protocol, guard, progress)
        note["result"] = (
            f"{point['seq_per_s']:.1f} seq/s ({point['seq_per_s'] / ceiling:.2f} of ceiling), "
            f"p99 {point['latency_ms']['p99']:.0f} ms"
            + (f", errors {point['errors']}" if point["errors"] else "")
            + (f", other processes {point['other_cpu_cores']:.2f} cores" if point["disturbed"] else "")
        )
    return point


def run(args: argparse.Namespace, out: TextIO | None = None) -> Path:
    """The whole benchmark; returns the results directory."""
    opt = options.resolve(args)
    started = time.perf_counter()
    output = Path(opt["output"])  # made by main()
    # HTTP is measured beside gRPC with one policy's server (the default policy's, when it runs), on the
    # workloads sent as text: the OpenAI route is for text, and one policy shows the protocol's cost.
    http_protocols = [p for p in opt["protocols"] if p.startswith("http")]
    http_batching = "length" if "length" in opt["batching"] else opt["batching"][0]
    http_workloads = options.text_workloads(opt["workloads"])
    # One client from a synchronous stub, beside the load generator's one client, on the HTTP server.
    lone = GRPC_SYNC in opt["protocols"] and 1 in opt["concurrency"]
    n_points = len(opt["concurrency"]) * (
        len(opt["batching"]) * len(opt["workloads"]) + len(http_protocols) * len(http_workloads)
    ) + lone * len(opt["workloads"])
    paired_steps = opt["paired"] * (
        ("fixed" in opt["workloads"]) + ("short" in opt["workloads"]) * (1 + (1 in opt["concurrency"]))
    )
    beside_steps = max(1, opt["paired"]) if opt["beside_bulk"] and "short" in opt["workloads"] else 0
    progress = Progress(2 + 2 * len(opt["batching"]) + n_points + paired_steps + beside_steps + 2, out)
    machine = describe_machine()
    machine["load_before"] = machine.pop("load")
    guard = Guard(max_other_cores=opt["max_other_cpu"], retries=opt["retries"], quiet_wait_s=opt["quiet_wait"])

    with contextlib.ExitStack() as stack:
        with progress.step("model and workloads") as note:
            repository, entry = entries.chosen_entry(opt, stack)
            model_name = entry.name
            workloads = entries.workloads(opt, entry)
            note["result"] = f"{entry.name} v{entry.version} ({entry.graph}), " + ", ".join(
                f"{w.name}: {len(w.ids)} inputs" for w in workloads.values()
            )
            memory_graphs, memory_skipped = memory.graphs_to_measure(opt["graphs"], entry.manifest.graphs, GRAPHS)
            if not opt["rss_requests"]:
                memory_graphs = []
            progress.total += len(memory_graphs)

        try:
            served = (
                options.served_batching(opt["concurrency"], opt["server_arg"], report.HEADLINE_CLIENTS)
                if "length" in opt["batching"]
                else None
            )
            # Batches computed side by side as the server's inference workers compute them (None: one worker).
            side_by_side = options.side_by_side(opt["threads"], opt["server_arg"], device=opt["device"])
        except ValueError as e:
            raise BenchError(str(e)) from None
        with progress.step(
            "in-process: ONNX Runtime batch sweep, one at a time, side by side, PyTorch eager (child process)",
            reports=True,
        ):
            spec = {
                "repository": str(repository),
                "model": model_name,
                "graph": opt["graph"],
                "device": opt["device"],
                "threads": opt["threads"],
                "batch_sizes": opt["batch_sizes"],
                "min_time": opt["min_time"],
                "torch": not opt["no_torch"],
                "torch_batch_size": opt["torch_batch_size"],
                "workloads": [w.to_dict() for w in workloads.values()],
                "guard": dataclasses.asdict(guard),
                # The length policy's batches for the headline's clients, timed in process (inprocess.served_batches).
                "served": served,
                "side_by_side": side_by_side,
            }
            inprocess = measure_in_child(spec)

        servers: dict[str, dict[str, list[dict[str, Any]]]] = {}
        http_points: dict[str, dict[str, list[dict[str, Any]]]] = {p: {} for p in http_protocols}
        lone_points: dict[str, dict[str, Any]] = {}
        # The headline (fixed workload, 32 clients) once more, alternating with the ceiling: slow drift of a
        # shared machine then moves both sides of each ratio alike; and the short workload's split (the
        # server's batches, gRPC and HTTP against the ceiling) in turns too. Both on the server HTTP is
        # measured on: the length policy's when it runs.
        paired: dict[str, Any] | None = None
        paired_short: dict[str, Any] | None = None
        paired_lone: dict[str, Any] | None = None
        beside_bulk: dict[str, Any] | None = None
        model_info: dict[str, Any] = {}
        # Every policy's server runs for the whole sweep, and the policies take turns at each point: on a
        # shared machine, whose speed drifts by 10-20 % over minutes, a policy measured in a slow minute
        # would otherwise lose to one measured in a fast one. The server not being measured sits idle.
        live: dict[str, Server] = {}
        try:
            for batching in opt["batching"]:
                server = Server(
                    repository,
                    models=[model_name],
                    batching=batching,
                    graph=opt["graph"],
                    device=opt["device"],
                    threads=opt["threads"],
                    extra=opt["server_arg"],
                    log_path=output / f"server-{batching}.log",
                    grpc_client=opt["grpc_client"],
                )
                live[batching] = server
                with progress.step(f"start `mhaserve serve --batching {batching}`") as note:
                    info = server.start()
                    note["result"] = f"SERVING on {server.address}, {info.graph} graph on {info.execution_provider}"
                if info.sha256 != entry.sha256:
                    raise BenchError(
                        f"the server serves graph {info.sha256[:12]}…, in-process ran {entry.sha256[:12]}…"
                    )
                model_info = {
                    "name": info.name,
                    "version": info.version,
                    "graph": info.graph,
                    "provider": info.execution_provider,
                    "sha256": info.sha256,
                    "layers": info.layers,
                    "dimensions": info.dimensions,
                    "max_tokens_per_input": info.max_tokens_per_input,
                    "max_batch_tokens": info.max_batch_tokens,
                    "max_queue_size": info.max_queue_size,
                }
            for wname, workload in workloads.items():
                ceiling = inprocess[wname]["ceiling"]["seq_per_s"]
                for c in opt["concurrency"]:
                    for batching, server in live.items():
                        turns = ["grpc"]
                        if batching == http_batching and wname in http_workloads:
                            turns += http_protocols
                        if batching == http_batching and lone and c == 1:
                            turns.append(GRPC_SYNC)
                        for protocol in turns:
                            point = _point(opt, server, workload, c, protocol, ceiling, guard, progress)
                            if protocol == GRPC_SYNC:
                                lone_points[wname] = point
                                continue
                            into = servers.setdefault(batching, {}) if protocol == "grpc" else http_points[protocol]
                            into.setdefault(wname, []).append(point)
            if opt["paired"] > 0 and "fixed" in workloads:
                paired = _paired(opt, spec, live[http_batching], workloads["fixed"], inprocess, guard, progress)
            if opt["paired"] > 0 and "short" in workloads:
                http = paired_http(http_protocols)
                short = workloads["short"]
                paired_short = _paired_short(opt, spec, live[http_batching], short, inprocess, http, guard, progress)
                if 1 in opt["concurrency"]:
                    sync = [GRPC_SYNC] if GRPC_SYNC in opt["protocols"] else []
                    protocols = ["grpc", *sync, *([http] if http else [])]
                    paired_lone = _paired_lone(
                        opt,
                        spec,
                        live[http_batching],
                        short,
                        protocols,
                        model_info["dimensions"],
                        # Whole milliseconds: epoll waits in those, and would count a fraction rounded up as floor.
                        float(math.floor(inprocess["short"]["one_at_a_time"]["latency_ms"]["p50"])),
                        output / "server-empty.log",
                        guard,
                        progress,
                    )
            if beside_steps:
                beside_bulk = _beside_bulk(opt, spec, live[http_batching], workloads["short"], progress)
        finally:
            for batching, server in live.items():
                with progress.step(f"stop the {batching} server (SIGTERM)") as note:
                    rc = server.stop()
                    note["result"] = f"exit status {rc}"

        with progress.step(
            "the ceiling again, to see how much the machine drifted during the run", reports=True
        ) as note:
            again = measure_in_child(
                dict(
                    spec,
                    torch=False,
                    served=None,
                    side_by_side=None,
                    batch_sizes_by_workload={w: [r["ceiling"]["batch_size"]] for w, r in inprocess.items()},
                )
            )
            for wname, r in again.items():
                before = inprocess[wname]["ceiling"]["seq_per_s"]
                inprocess[wname]["ceiling_after"] = {
                    "seq_per_s": r["ceiling"]["seq_per_s"],
                    "batch_size": r["ceiling"]["batch_size"],
                    "drift": r["ceiling"]["seq_per_s"] / before - 1,
                    "other_cpu_cores": r["ceiling"].get("other_cpu_cores"),
                    "disturbed": r["ceiling"].get("disturbed", False),
                }
            note["result"] = ", ".join(f"{w}: {inprocess[w]['ceiling_after']['drift']:+.0%}" for w in inprocess)

        memory_runs = memory.measure_graphs(
            entry,
            memory_graphs,
            lambda graph: Server(
                repository,
                models=[model_name],
                batching=http_batching,
                graph=graph,
                device=opt["device"],
                threads=opt["threads"],
                extra=opt["server_arg"],
                log_path=output / f"server-memory-{graph}.log",
                grpc_client=opt["grpc_client"],
            ),
            workloads[memory.pick_workload(workloads)],
            requests=opt["rss_requests"],
            clients=report.HEADLINE_CLIENTS,
            progress=progress,
        )

        machine["load_after"] = load()
        result = {
            "format": 1,
            "created": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "elapsed_s": time.perf_counter() - started,
            "command": options.command_line(args),
            "machine": machine,
            "model": model_info,
            "settings": {
                "threads": opt["threads"],
                "device": opt["device"],
                "graph": opt["graph"],
                "concurrency": list(opt["concurrency"]),
                "protocols": list(opt["protocols"]),
                "grpc_client": opt["grpc_client"],
                "batch_sizes": list(opt["batch_sizes"]),
                "duration_s": opt["duration"],
                "min_time_s": opt["min_time"],
                "server_args": list(opt["server_arg"]),
                "server_threads": options.server_threads(opt["threads"], opt["server_arg"], device=opt["device"]),
                "server_max_wait_ms": options.server_flags(opt["server_arg"]).get("--max-wait-ms", "device default"),
                "beside_bulk": list(opt["beside_bulk"]),
                "quick": opt["quick"],
                "guard": dataclasses.asdict(guard),
            },
            "workloads": {name: w.summary() for name, w in workloads.items()},
            "inprocess": inprocess,
            "server": servers,
            "http": {"batching": http_batching, "route": "POST /v1/embeddings", "protocols": http_points}
            if http_points
            else None,
            "paired": paired,
            "paired_short": paired_short,
            "lone": {"batching": http_batching, "protocol": GRPC_SYNC, "points": lone_points} if lone_points else None,
            "paired_lone": paired_lone,
            "beside_bulk": beside_bulk,
            "memory": memory.result(http_batching, memory_runs, memory_skipped) if opt["rss_requests"] else None,
        }
        with progress.step("report and plots") as note:
            files = report.write(result, output)
            note["result"] = ", ".join(str(f) for f in files)
    return output


def main(args: argparse.Namespace) -> int:
    from mhaserve.runtime.errors import ServiceError
    from mhaserve.runtime.repository import RepositoryError

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # so that the servers this run started are stopped on the way out

    if (problem := options.refused(args)) is not None:
        print(f"mhaserve bench: error: {problem}", file=sys.stderr)
        return 2
    kind = "bench-models" if args.models else "bench-memory" if args.memory_only else "bench"
    args.output = args.output or f"results/{kind}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    # Made here for the three runs, before anything is measured: a file there, or a path through one, ended in
    # a traceback.
    try:
        Path(args.output).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file of that name is there" if isinstance(e, FileExistsError) else e.strerror
        print(f"mhaserve bench: error: cannot make the results folder {args.output}: {why}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, interrupted)
    try:
        output = models.run(args) if args.models else memory_only.run(args) if args.memory_only else run(args)
    except KeyboardInterrupt:
        print("mhaserve bench: interrupted", file=sys.stderr)
        return 130
    except (BenchError, RepositoryError, ServiceError) as e:
        print(f"mhaserve bench: error: {e}", file=sys.stderr)
        return 1
    print((output / "report.md").read_text())
    print(f"results in {output}/", file=sys.stderr)
    # A measurement that failed is written and marked in the report, and fails the run, as a failed check does
    # the reliability run's; the other runs' reports have none.
    if failed := json.loads((output / "report.json").read_text()).get("failed"):
        print(
            f"mhaserve bench: error: a measurement failed (the report marks it): {'; '.join(failed)}", file=sys.stderr
        )
        return 1
    return 0
