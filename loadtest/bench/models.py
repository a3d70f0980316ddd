"""`mhaserve bench --models A,B`: one server serving several models, each model's clients alone and then all
of them at once.

The server (`mhaserve serve --model A --model B`) runs every model's batches on its one inference thread,
in turn, with all the cores (docs/models.md). What that costs is measured here: at each client count, the
clients of one model with the others idle (the same server, every model loaded), each model in turn, then
every model's clients at once, `concurrency` clients per model. A model's share is its throughput together
over its throughput alone; the shares add up to 1 when the models split the machine without loss. Outputs:
report.md and report.json (and the server's log) in results/bench-models-<timestamp>/ or --output.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import json
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from mhaserve.loadtest.bench import entries, options, report
from mhaserve.loadtest.bench.client import Server, run_models_point
from mhaserve.loadtest.bench.quiet import Guard
from mhaserve.loadtest.bench.report import errors_cell, fmt
from mhaserve.loadtest.bench.workloads import Workload
from mhaserve.loadtest.machine import load
from mhaserve.loadtest.machine import machine as describe_machine
from mhaserve.runtime.progress import Progress


def _point(
    opt: dict[str, Any],
    server: Server,
    workloads: dict[str, Workload],
    clients: int,
    guard: Guard,
    progress: Progress,
) -> dict[str, Any]:
    """One measurement: `clients` clients for each model of `workloads`, all at once."""
    what = " + ".join(workloads) if len(workloads) > 1 else f"{next(iter(workloads))} alone"
    name = next(iter(workloads.values())).name
    with progress.step(f"{name:5} {clients:3} clients per model: {what}") as note:
        point = guard.measure(
            functools.partial(
                run_models_point,
                server,
                workloads,
                clients,
                duration=opt["duration"],
                warmup_max=max(5.0, 3 * opt["duration"]),
            ),
            progress.say,
        )
        note["result"] = ", ".join(
            f"{m} {r['seq_per_s']:.1f} seq/s p50 {r['latency_ms']['p50']:.1f} ms" for m, r in point["models"].items()
        ) + (f", other processes {point['other_cpu_cores']:.2f} cores" if point["disturbed"] else "")
    return point


def run(args: argparse.Namespace, out: TextIO | None = None) -> Path:
    """The several-models run; returns the results directory."""
    opt = options.resolve(args)
    names = list(opt["models"])
    started = time.perf_counter()
    output = Path(opt["output"])  # made by run.main()
    batching = "length" if "length" in opt["batching"] else opt["batching"][0]
    n_points = len(opt["workloads"]) * len(opt["concurrency"]) * (len(names) + 1)
    progress = Progress(4 + n_points, out)
    machine = describe_machine()
    machine["load_before"] = machine.pop("load")
    guard = Guard(max_other_cores=opt["max_other_cpu"], retries=opt["retries"], quiet_wait_s=opt["quiet_wait"])

    with contextlib.ExitStack() as stack:
        with progress.step("models and workloads") as note:
            repository = Path(opt["repository"] or "models")
            if opt["quick"] and not opt["repository"]:
                tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mhaserve-bench-")))
                repository = entries.quick_repository(tmp, names, optimize=False)
            found = {name: entries.entry(repository, name, opt["graph"], opt["device"]) for name in names}
            workloads = {name: entries.workloads(opt, e) for name, e in found.items()}
            note["result"] = ", ".join(f"{e.name} v{e.version} ({e.graph})" for e in found.values())

        server = Server(
            repository,
            models=names,
            batching=batching,
            graph=opt["graph"],
            device=opt["device"],
            threads=opt["threads"],
            extra=opt["server_arg"],
            log_path=output / "server.log",
        )
        with progress.step(f"start `mhaserve serve {' '.join(f'--model {n}' for n in names)}`") as note:
            stack.enter_context(server.running())
            infos = {name: server.model_info(name) for name in names}
            note["result"] = f"SERVING on {server.address}"
        points: dict[str, list[dict[str, Any]]] = {}
        try:
            # Each model alone, then all together, at each client count: in turns, so that the slow drift of
            # a shared machine moves both sides of each share alike.
            for wname in opt["workloads"]:
                for c in opt["concurrency"]:
                    alone = {
                        name: _point(opt, server, {name: workloads[name][wname]}, c, guard, progress) for name in names
                    }
                    together = _point(opt, server, {n: workloads[n][wname] for n in names}, c, guard, progress)
                    points.setdefault(wname, []).append({"clients": c, "alone": alone, "together": together})
        finally:
            with progress.step("stop the server (SIGTERM)") as note:
                note["result"] = f"exit status {server.stop()}"

    machine["load_after"] = load()
    result = {
        "format": 1,
        "kind": "models",
        "created": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "elapsed_s": time.perf_counter() - started,
        "command": options.command_line(args),
        "machine": machine,
        "models": {
            name: {
                "version": info.version,
                "graph": info.graph,
                "provider": info.execution_provider,
                "sha256": info.sha256,
                "layers": info.layers,
                "dimensions": info.dimensions,
            }
            for name, info in infos.items()
        },
        "settings": {
            "batching": batching,
            "threads": opt["threads"],
            "device": opt["device"],
            "concurrency": list(opt["concurrency"]),
            "duration_s": opt["duration"],
            "server_args": list(opt["server_arg"]),
            "server_threads": options.server_threads(opt["threads"], opt["server_arg"]),
            "quick": opt["quick"],
            "guard": dataclasses.asdict(guard),
        },
        "workloads": {name: {w: wl.summary() for w, wl in ws.items()} for name, ws in workloads.items()},
        "points": points,
    }
    with progress.step("report") as note:
        result["summary"] = summarize(result)
        (output / "report.json").write_text(json.dumps(result, indent=2) + "\n")
        (output / "report.md").write_text(markdown(result))
        note["result"] = f"{output / 'report.md'}, {output / 'report.json'}"
    return output


def _cpu_per_request_ratio(row: dict[str, Any]) -> float | None:
    """The server's CPU together over what the same requests cost alone: each model's requests together priced
    at its CPU per request alone. 1.0 when serving the models together costs no extra CPU; above 1 when they
    get in each other's way (oversubscribed cores, cache misses). Unlike throughput it holds on a machine
    whose other work takes a varying part of the cores: it counts the server's CPU, not the time it got."""
    together = row["together"]
    expected = 0.0
    for name, alone in row["alone"].items():
        cores, seq = alone["server_cpu_cores"], alone["models"][name]["seq_per_s"]
        if cores is None or not seq:
            return None
        expected += together["models"][name]["seq_per_s"] * cores / seq
    return together["server_cpu_cores"] / expected if together["server_cpu_cores"] is not None and expected else None


def summarize(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per workload and client count: each model's throughput and p50 alone and together, its share (together
    over alone), and the sum of the shares."""
    out: dict[str, list[dict[str, Any]]] = {}
    for wname, rows in result["points"].items():
        for row in rows:
            models = {}
            for name, alone in row["alone"].items():
                a, t = alone["models"][name], row["together"]["models"][name]
                models[name] = {
                    "alone_seq_per_s": a["seq_per_s"],
                    "together_seq_per_s": t["seq_per_s"],
                    "share": t["seq_per_s"] / a["seq_per_s"] if a["seq_per_s"] else None,
                    "alone_p50_ms": a["latency_ms"]["p50"],
                    "together_p50_ms": t["latency_ms"]["p50"],
                    "alone_p99_ms": a["latency_ms"]["p99"],
                    "together_p99_ms": t["latency_ms"]["p99"],
                    "errors": {
                        k: a["errors"].get(k, 0) + t["errors"].get(k, 0) for k in {**a["errors"], **t["errors"]}
                    },
                    "alone_server_cpu_cores": alone["server_cpu_cores"],
                    "alone_other_cpu_cores": alone["other_cpu_cores"],
                    "disturbed": bool(alone.get("disturbed") or row["together"].get("disturbed")),
                }
            shares = [m["share"] for m in models.values()]
            out.setdefault(wname, []).append(
                {
                    "clients": row["clients"],
                    "models": models,
                    "together_seq_per_s": row["together"]["seq_per_s"],
                    "sum_of_shares": None if None in shares else sum(s for s in shares if s is not None),
                    "cpu_per_request_ratio": _cpu_per_request_ratio(row),
                    "together_server_cpu_cores": row["together"]["server_cpu_cores"],
                    "together_other_cpu_cores": row["together"]["other_cpu_cores"],
                    "together_disturbed": bool(row["together"].get("disturbed")),
                }
            )
    return out


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = report.header(result, "mhaserve bench: several models in one server")
    lines += [
        "- **Models**: "
        + "; ".join(
            f"{name} v{m['version']} ({m['layers']} layers, {m['dimensions']} dims, `{m['graph']}` graph on "
            f"{m['provider']})"
            for name, m in result["models"].items()
        ),
        f"- **Server**: {s['batching']} batching, ONNX Runtime intra-op threads "
        f"{s['server_threads']}, "
        f"extra flags {' '.join(s['server_args']) or 'none'}; {s['duration_s']:g} s measured per point",
        "",
        "## Each model alone and together",
        "",
        "| workload | clients per model | model | alone seq/s | together seq/s | share | alone p50 ms "
        "| together p50 ms | alone p99 ms | together p99 ms | server CPU | other CPU | errors |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for wname, rows in result["summary"].items():
        for row in rows:
            for name, m in row["models"].items():
                errors = errors_cell(m["errors"])
                lines.append(
                    f"| {wname} | {row['clients']} | {name} | {fmt(m['alone_seq_per_s'])} | "
                    f"{fmt(m['together_seq_per_s'])} | {fmt(m['share'], 2)} | "
                    f"{fmt(m['alone_p50_ms'])} | {fmt(m['together_p50_ms'])} | "
                    f"{fmt(m['alone_p99_ms'])} | {fmt(m['together_p99_ms'])} | {fmt(m['alone_server_cpu_cores'], 2)} | "
                    f"{fmt(m['alone_other_cpu_cores'], 2)}{' *' if m['disturbed'] else ''} | {errors} |"
                )
            lines.append(
                f"| {wname} | {row['clients']} | **together** | | {fmt(row['together_seq_per_s'])} | "
                f"**{fmt(row['sum_of_shares'], 2)}** | | | | | {fmt(row['together_server_cpu_cores'], 2)} | "
                f"{fmt(row['together_other_cpu_cores'], 2)}{' *' if row['together_disturbed'] else ''} | "
                f"CPU per request {fmt(row['cpu_per_request_ratio'], 2)}"
                " of alone |"
            )
    lines += [
        "",
        "Alone: one model's clients, the other models loaded and idle in the same server. Together: every "
        "model's clients at once, as many per model as alone. Share: a model's throughput together over its "
        "throughput alone; the sum of the shares is 1.00 when the models split the machine without loss, below 1 "
        "when serving them together costs more than the sum of its parts. Latency is client-side, per request; "
        f"`*` marks a figure measured while other processes took more than {s['guard']['max_other_cores']} cores. "
        "The together row: every model's throughput added up, the sum of the shares, and the CPU of the together "
        "point (server CPU and other processes', in cores), and the server's CPU per request together over alone "
        "(each model's requests priced at its CPU per request alone): 1.00 when the models cost no more together, "
        "above 1 when they get in each other's way. On a machine where other work takes a varying part of the "
        "cores, throughput moves with it and the shares with it; the CPU per request does not.",
        "",
    ]
    return "\n".join(lines)
