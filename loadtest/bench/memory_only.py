"""`mhaserve bench --memory-only`: the server-memory run of the bench (memory.py) without the sweep before it.

The sweep takes many minutes and says nothing about memory; issue 18's figure (resident memory after
warm-up and after N requests, per graph) is wanted on its own, and often with a larger N. Outputs:
report.md and report.json (and each server's log) in results/bench-memory-<timestamp>/ or --output.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any, TextIO

from mhaserve.loadtest.bench import entries, memory, options, report
from mhaserve.loadtest.bench.client import BenchError, Server
from mhaserve.loadtest.machine import load
from mhaserve.loadtest.machine import machine as describe_machine
from mhaserve.runtime.progress import Progress
from mhaserve.runtime.repository import GRAPHS


def run(args: argparse.Namespace, out: TextIO | None = None) -> Path:
    """The memory run alone; returns the results directory."""
    opt = options.resolve(args)  # --rss-requests 0 is refused before (options.unread)
    started = time.perf_counter()
    output = Path(opt["output"])  # made by run.main()
    batching = "length" if "length" in opt["batching"] else opt["batching"][0]
    progress = Progress(2, out)
    machine = describe_machine()
    machine["load_before"] = machine.pop("load")

    with contextlib.ExitStack() as stack:
        with progress.step("model and workload") as note:
            repository, entry = entries.chosen_entry(opt, stack)
            # Only the workload the memory run sends is built (the short corpus by default).
            wname = memory.pick_workload(opt["workloads"])
            workload = entries.workloads(dict(opt, workloads=(wname,)), entry)[wname]
            graphs, skipped = memory.graphs_to_measure(opt["graphs"], entry.manifest.graphs, GRAPHS)
            if not graphs:  # the run's one measurement: a report of none was written, and the run exited 0
                raise BenchError("no graph to measure: " + "; ".join(f"{g}: {why}" for g, why in skipped.items()))
            progress.total += len(graphs)
            inputs = f"{workload.name}: {len(workload.ids)} inputs"
            note["result"] = f"{entry.name} v{entry.version}, {inputs}; graphs {', '.join(graphs)}"
            for graph, why in skipped.items():
                progress.say(f"  skipping {graph}: {why}")

        runs = memory.measure_graphs(
            entry,
            graphs,
            lambda graph: Server(
                repository,
                models=[entry.name],
                batching=batching,
                graph=graph,
                device=opt["device"],
                threads=opt["threads"],
                extra=opt["server_arg"],
                log_path=output / f"server-memory-{graph}.log",
            ),
            workload,
            requests=opt["rss_requests"],
            clients=report.HEADLINE_CLIENTS,
            progress=progress,
        )

    machine["load_after"] = load()
    result: dict[str, Any] = {
        "format": 1,
        "kind": "memory",
        "created": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "elapsed_s": time.perf_counter() - started,
        "command": options.command_line(args),
        "machine": machine,
        "model": {"name": entry.name, "version": entry.version},
        "settings": {
            "threads": opt["threads"],
            "device": opt["device"],
            "server_args": list(opt["server_arg"]),
            "server_threads": options.server_threads(opt["threads"], opt["server_arg"], device=opt["device"]),
            "quick": opt["quick"],
        },
        "workloads": {workload.name: workload.summary()},
        "memory": memory.result(batching, runs, skipped),
    }
    with progress.step("report") as note:
        (output / "report.json").write_text(json.dumps(result, indent=2) + "\n")
        (output / "report.md").write_text(markdown(result))
        note["result"] = f"{output / 'report.md'}, {output / 'report.json'}"
    return output


def markdown(result: dict[str, Any]) -> str:
    m, s = result["model"], result["settings"]
    lines = report.header(result, "mhaserve bench: server memory")
    lines += [
        f"- **Model**: {m['name']} v{m['version']}",
        f"- **Server**: ONNX Runtime intra-op threads {s['server_threads']}, "
        f"extra flags {' '.join(s['server_args']) or 'none'}",
        "",
    ]
    return "\n".join(lines + report.memory_section(result["memory"]))
