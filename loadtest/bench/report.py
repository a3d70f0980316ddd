"""The benchmark's outputs: report.json (everything), report.md (the tables), throughput.png and latency.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HEADLINE_CLIENTS = 32


def fmt(value: float | None, digits: int = 1) -> str:
    """A figure as the reports print it: thousands separated, `digits` decimals, "-" for none."""
    return "-" if value is None else f"{value:,.{digits}f}"


def errors_cell(errors: dict[str, int]) -> str:
    """A point's failed calls as a table cell: "HTTP 429 3, timeout 1", or 0."""
    return ", ".join(f"{kind} {count}" for kind, count in errors.items()) or "0"


def _size(batch_size: float) -> str:
    """A batch size: whole for a fixed one, one decimal for a mean."""
    return str(batch_size) if isinstance(batch_size, int) else fmt(batch_size)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _mark(r: dict[str, Any]) -> str:
    return " *" if r.get("disturbed") else ""


def _http_runs(report: dict[str, Any]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """{protocol: {workload: points}} of the HTTP points ({} when none were measured)."""
    http = report.get("http") or {}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = http.get("protocols", {})
    return runs


def _by_clients(points: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {p["concurrency"]: p for p in points}


# The short workload's paired ratios, as the report words them.
_RATIO_NAMES = {
    "served/ceiling": "the server's batches in process / ceiling",
    "side/ceiling": "batches side by side in process / ceiling",
    "grpc/ceiling": "gRPC / ceiling",
    "grpc/served": "gRPC / its batches in process",
    "grpc/side": "gRPC / side by side",
    "http/ceiling": "HTTP / ceiling",
    "http/served": "HTTP / its batches in process",
    "http/side": "HTTP / side by side",
    "http-base64/ceiling": "HTTP (base64) / ceiling",
    "http-base64/served": "HTTP (base64) / its batches in process",
    "http-base64/side": "HTTP (base64) / side by side",
}


# The paired one-client rounds' name for a protocol's turn on the empty server (empty.py): "empty grpc".
EMPTY = "empty "
IN_PROCESS = "in process"  # the paired rounds' turn of ONNX Runtime in a child process of the bench

# The clients of the one-client figures, as the report words them.
_CLIENT_NAMES = {
    "grpc": "gRPC (grpc.aio's client)",  # the load generator: the front is the server's
    "grpc-sync": "gRPC (synchronous stub)",
    "http": "HTTP",
    "http-base64": "HTTP (base64)",
}


def client_names(report: dict[str, Any]) -> dict[str, str]:
    """_CLIENT_NAMES for this run: gRPC's client is the bench's own HTTP/2 client with `--grpc-client h2`."""
    if (report.get("settings") or {}).get("grpc_client") == "h2":
        return _CLIENT_NAMES | {"grpc": "gRPC (the bench's HTTP/2 client)"}
    return _CLIENT_NAMES


def _disturbed(report: dict[str, Any]) -> list[str]:
    """The figures taken beside more other work than the guard allows."""
    out = []
    for wname, inproc in report["inprocess"].items():
        out += [f"{wname} ORT batch {r['batch_size']}" for r in inproc["sweep"] if r.get("disturbed")]
        torch = inproc.get("pytorch") or {}
        if torch.get("disturbed"):
            out.append(f"{wname} PyTorch")
    for batching, runs in report["server"].items():
        for wname, points in runs.items():
            out += [f"{wname} {batching} {p['concurrency']} clients" for p in points if p.get("disturbed")]
    for protocol, runs in _http_runs(report).items():
        for wname, points in runs.items():
            out += [f"{wname} {protocol} {p['concurrency']} clients" for p in points if p.get("disturbed")]
    paired = report.get("paired") or {"pairs": []}
    out += [f"paired check {k + 1}" for k, p in enumerate(paired["pairs"]) if p["disturbed"]]
    short = report.get("paired_short") or {"rounds": []}
    out += [f"paired short round {k + 1}" for k, r in enumerate(short["rounds"]) if r["disturbed"]]
    lone_points = ((report.get("lone") or {}).get("points") or {}).items()
    out += [f"{wname} grpc-sync 1 client" for wname, p in lone_points if p.get("disturbed")]
    lone = report.get("paired_lone") or {"rounds": []}
    out += [f"paired one client round {k + 1}" for k, r in enumerate(lone["rounds"]) if r["disturbed"]]
    return out


def _one_client(report: dict[str, Any], wname: str) -> dict[str, Any] | None:
    """One client's p50 by client on the server the other protocols were measured on (the load generator's
    grpc.aio, a synchronous stub, HTTP), each against ONNX Runtime's on one input at a time in process."""
    on = (report.get("lone") or report.get("http") or {}).get("batching")
    if on is None:
        on = next((b for b in ("length", "arrival") if b in report["server"]), None)
    point = _by_clients(report["server"].get(on, {}).get(wname, [])).get(1) if on else None
    if point is None:
        return None
    points = {"grpc": point}
    lone = ((report.get("lone") or {}).get("points") or {}).get(wname)
    if lone is not None:
        points["grpc-sync"] = lone
    for protocol, runs in _http_runs(report).items():
        if (p := _by_clients(runs.get(wname, [])).get(1)) is not None:
            points[protocol] = p
    reference = report["inprocess"][wname]["one_at_a_time"]["latency_ms"]["p50"]
    return {
        "batching": on,
        "reference_p50_ms": reference,
        "clients": {
            name: {
                "p50_ms": p["latency_ms"]["p50"],
                "gap_ms": p["latency_ms"]["p50"] - reference,
                "p99_ms": p["latency_ms"]["p99"],
                "client_cpu_ms_per_request": p.get("client_cpu_ms_per_request"),
                "disturbed": bool(p.get("disturbed")),
            }
            for name, p in points.items()
        },
    }


def _http_over_grpc(report: dict[str, Any], wname: str) -> dict[str, list[dict[str, Any]]]:
    """Each HTTP protocol against gRPC on the same server, at each client count both were measured at."""
    http = report.get("http") or {}
    grpc = _by_clients(report["server"].get(http.get("batching", ""), {}).get(wname, []))
    out = {}
    for protocol, runs in _http_runs(report).items():
        rows = []
        for c, h in sorted(_by_clients(runs.get(wname, [])).items()):
            g = grpc.get(c)
            if g is None:
                continue
            rows.append(
                {
                    "clients": c,
                    "seq_per_s": h["seq_per_s"],
                    "grpc_seq_per_s": g["seq_per_s"],
                    "ratio": h["seq_per_s"] / g["seq_per_s"] if g["seq_per_s"] else None,
                    "p50_ms": h["latency_ms"]["p50"],
                    "grpc_p50_ms": g["latency_ms"]["p50"],
                    "p99_ms": h["latency_ms"]["p99"],
                    "grpc_p99_ms": g["latency_ms"]["p99"],
                    "client_cpu_ms_per_request": h.get("client_cpu_ms_per_request"),
                    "grpc_client_cpu_ms_per_request": g.get("client_cpu_ms_per_request"),
                }
            )
        if rows:
            out[protocol] = rows
    return out


# What the in-process table's rows beyond the ceiling measure, said under it when the report has them.
_IN_PROCESS_NOTES = {
    "served_batching": (
        " The server's batches are those its length policy forms when every client keeps one input waiting "
        "and nothing but the model takes time (the same limits, one inference worker): a one-worker server with "
        "no overhead of its own would serve that, so the server's figure against it is what lies around the "
        "model, and this row against the ceiling is what a closed loop of that many clients costs in batching. "
        "A server with several inference workers (the default on a CPU of two cores or more) forms smaller "
        "batches and computes one beside another, which this row does not model: there the server against it "
        "can pass 1."
    ),
    "side_by_side": (
        " Side by side: as many threads as the server has inference workers call one engine built as the server "
        "builds it (a batch beside another on its worker's share of the cores), taking the inputs sorted by "
        "length in batches from one queue: what the model serves on these cores computing as the server does, "
        "with nothing around it; the server against it is what its own work costs."
    ),
}


def _against(r: dict[str, Any], ceiling: float, **fields: Any) -> dict[str, Any]:
    """An in-process figure for the summary: `fields`, its seq/s and its ratio to the ceiling."""
    return {**fields, "seq_per_s": r["seq_per_s"], "ratio": r["seq_per_s"] / ceiling}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The headline figures: ratio to the ceiling at 32 clients (or the nearest), length vs arrival on mixed,
    one client against the model called one request at a time, and HTTP against gRPC."""
    out: dict[str, Any] = {}
    for wname, inproc in report["inprocess"].items():
        ceiling = inproc["ceiling"]["seq_per_s"]
        w: dict[str, Any] = {
            "ceiling_seq_per_s": ceiling,
            "ceiling_batch_size": inproc["ceiling"]["batch_size"],
            # ONNX Runtime on one input per call (tokenising it, for text): what one client waits for at least.
            "batch1_p50_ms": inproc["one_at_a_time"]["latency_ms"]["p50"],
        }
        for batching, runs in report["server"].items():
            points = runs.get(wname, [])
            if not points:
                continue
            at = min(points, key=lambda p: abs(p["concurrency"] - HEADLINE_CLIENTS))
            best = max(points, key=lambda p: p["seq_per_s"])
            one = _by_clients(points).get(1)
            w[batching] = {
                "one_client_p50_ms": one["latency_ms"]["p50"] if one else None,
                "clients": at["concurrency"],
                "seq_per_s": at["seq_per_s"],
                "ratio": at["seq_per_s"] / ceiling,
                "padding_fraction": at["padding_fraction"],
                "p99_ms": at["latency_ms"]["p99"],
                "best_seq_per_s": best["seq_per_s"],
                "best_clients": best["concurrency"],
                "best_ratio": best["seq_per_s"] / ceiling,
                "other_cpu_cores": at.get("other_cpu_cores"),
            }
        served = inproc.get("served_batching")
        if served:
            # Split the gap: the closed loop's batches against the ceiling, the server against its own batches.
            w["served_batching"] = _against(
                served, ceiling, clients=served["clients"], mean_batch_size=served["batch_size"]
            )
        side = inproc.get("side_by_side")
        if side:
            # The model computing as a server of several workers computes it, nothing around it.
            w["side_by_side"] = _against(side, ceiling, workers=side["workers"], batch_size=side["batch_size"])
        if "length" in w and "arrival" in w:
            w["length_over_arrival"] = w["length"]["seq_per_s"] / w["arrival"]["seq_per_s"]
        if wname == "fixed" and report.get("paired"):
            w["paired_median_ratio"] = report["paired"]["median_ratio"]
        if wname == "short" and report.get("paired_short"):
            w["paired"] = {"rounds": len(report["paired_short"]["rounds"]), **report["paired_short"]["median"]}
        http = _http_over_grpc(report, wname)
        if http:
            w["http"] = {"batching": report["http"]["batching"], "protocols": http}
        one_client = _one_client(report, wname)
        if one_client:
            w["one_client"] = one_client
        lone = report.get("paired_lone")
        if lone and lone["workload"] == wname:
            w["paired_one_client"] = {
                "rounds": len(lone["rounds"]),
                "gap_ms": lone["median_gap_ms"],
                "empty_server_p50_ms": lone.get("median_floor_ms", {}),
                "above_empty_server_ms": lone.get("median_above_floor_ms", {}),
            }
        mixed_traffic = report.get("beside_bulk")
        if mixed_traffic and mixed_traffic["workload"] == wname:
            w["beside_bulk"] = {
                "rounds": len(mixed_traffic["rounds"]),
                "by_bulk_clients": mixed_traffic["median"],
                "alone_in_process": mixed_traffic.get("in_process"),
            }
        out[wname] = w
    return out


def _int8(machine: dict[str, Any]) -> str:
    """The machine line's clause on int8 kernels, as "(int8 products on AMX)"; none in an older report."""
    return f" (int8 products on {machine['int8_kernel']})" if "int8_kernel" in machine else ""


def header(report: dict[str, Any], title: str) -> list[str]:
    """The title, when, the command that reproduces the run, the machine and its load, the software."""
    machine = report["machine"]
    return [
        f"# {title}",
        "",
        f"- **When**: {report['created']} ({report['elapsed_s']:.0f} s)",
        f"- **Command**: `{report['command']}`",
        f"- **Machine**: {machine['cpu']}{_int8(machine)}, {machine['cores']} cores, {machine['memory_gib']:.0f} GiB; "
        f"{machine['platform']}; load average {machine['load_before']} before, {machine['load_after']} after",
        f"- **Software**: python {machine['python']}, " + ", ".join(f"{k} {v}" for k, v in machine["packages"].items()),
    ]


def _paired_line(
    title: str,
    rounds: list[dict[str, Any]],
    what: str,
    figures: dict[str, tuple[float, list[float], str]],
    unit: str = "",
) -> str:
    """A summary line of paired rounds: `figures` names each figure's median, its rounds' values and their format."""
    return (
        f"- **{title} {len(rounds)} round(s), each measuring {', '.join(rounds[0]['order'])} in turn, the next "
        f"round starting one turn later): {what} "
        + ", ".join(
            f"{name} **{form.format(median)}{unit}** ("
            + ", ".join(f"{form.format(v)}{_mark(r)}" for v, r in zip(values, rounds, strict=True))
            + ")"
            for name, (median, values, form) in figures.items()
        )
    )


def markdown(report: dict[str, Any]) -> str:
    names = client_names(report)
    m, s, machine = report["model"], report["settings"], report["machine"]
    lines = [
        *header(report, "mhaserve bench"),
        f"- **Model**: {m['name']} v{m['version']} ({m['layers']} layers, {m['dimensions']} dims), "
        f"`{m['graph']}` graph on {m['provider']} (sha256 {m['sha256'][:12]}…)",
        f"- **Threads**: ONNX Runtime intra-op {s['server_threads']}; "
        f"server limits: max batch tokens {m['max_batch_tokens']}, max wait {s['server_max_wait_ms']}, "
        f"extra server flags {' '.join(s['server_args']) or 'none'}",
        "",
    ]
    for wname, w in report["workloads"].items():
        lines.append(
            f"- **{wname}** workload: {w['description']}; {w['inputs']} inputs, tokens mean {w['mean_tokens']:.1f}, "
            f"median {w['median_tokens']}, max {w['max_tokens']}"
        )
    lines += ["", "## Summary", ""]
    if report.get("failed"):  # first: none of it is a result
        lines.append("- **FAILED** (no result, the run exited 1): " + "; ".join(report["failed"]))
    for wname, w in report["summary"].items():
        parts = [
            f"ceiling {fmt(w['ceiling_seq_per_s'])} seq/s (ONNX Runtime in-process, batch {w['ceiling_batch_size']})"
        ]
        for batching in ("length", "arrival"):
            if batching in w:
                b = w[batching]
                parts.append(
                    f"server ({batching}) at {b['clients']} clients {fmt(b['seq_per_s'])} seq/s = "
                    f"**{b['ratio']:.2f}** of the ceiling (best {b['best_ratio']:.2f} at {b['best_clients']})"
                )
        served = w.get("served_batching")
        if served:
            part = (
                f"the server's own batches for {served['clients']} clients, run in process: "
                f"{fmt(served['seq_per_s'])} seq/s = {served['ratio']:.2f} of the ceiling"
            )
            length = w.get("length") or {}
            if length.get("clients") == served["clients"]:
                part += f"; the server (length) at {length['seq_per_s'] / served['seq_per_s']:.2f} of that"
            parts.append(part)
        side = w.get("side_by_side")
        if side:
            part = (
                f"{side['workers']} batches side by side in process, as the server's workers compute them (batch "
                f"{side['batch_size']}): {fmt(side['seq_per_s'])} seq/s = {side['ratio']:.2f} of the ceiling"
            )
            if "length" in w:
                part += f"; the server (length) at {w['length']['seq_per_s'] / side['seq_per_s']:.2f} of that"
            parts.append(part)
        if "length_over_arrival" in w:
            parts.append(f"length-aware / arrival-order = **{w['length_over_arrival']:.2f}x**")
        one_client = w.get("one_client")
        if one_client:
            parts.append(
                f"1 client ({one_client['batching']}), p50 against {fmt(one_client['reference_p50_ms'], 2)} ms for "
                "ONNX Runtime one input at a time: "
                + ", ".join(
                    f"{names.get(name, name)} {fmt(c['p50_ms'], 2)} ms ({c['gap_ms']:+.2f})"
                    for name, c in one_client["clients"].items()
                )
            )
        for protocol, rows in (w.get("http") or {}).get("protocols", {}).items():
            ratios = ", ".join(f"{r['ratio']:.2f} at {r['clients']}" for r in rows if r["ratio"] is not None)
            parts.append(f"{protocol} / gRPC throughput ({w['http']['batching']} server): **{ratios}**")
        lines.append(f"- **{wname}**: " + "; ".join(parts))
    paired = report.get("paired")
    if paired:
        ratios = ", ".join(f"{p['ratio']:.2f}{_mark(p)}" for p in paired["pairs"])
        lines.append(
            f"- **paired check** (fixed workload, {paired['batching']} batching, {paired['clients']} clients, the "
            f"ceiling at batch {paired['batch_size']} measured just before each server run): ratios {ratios}; "
            f"median **{paired['median_ratio']:.2f}**"
        )
    short = report.get("paired_short")
    if short:
        lines.append(
            _paired_line(
                f"paired check, short workload** ({short['batching']} batching, {short['clients']} clients;",
                short["rounds"],
                "medians",
                {
                    _RATIO_NAMES[name]: (value, [r["ratios"][name] for r in short["rounds"]], "{:.2f}")
                    for name, value in short["median"].items()
                },
            )
        )
    lone = report.get("paired_lone")
    if lone:
        gaps = lone["median_gap_ms"]
        lines.append(
            _paired_line(
                f"paired check, one client, {lone['workload']} workload** ({lone['batching']} batching;",
                lone["rounds"],
                "p50 less ONNX Runtime's one input at a time in process, medians",
                {names.get(p, p): (gaps[p], [r["gap_ms"][p] for r in lone["rounds"]], "{:+.2f}") for p in gaps},
                unit=" ms",
            )
            + f"; in process {fmt(lone['median_p50_ms']['in process'], 2)} ms"
            + _floor_clause(lone, names)
        )
    if report.get("beside_bulk"):
        lines.append(_beside_bulk_line(report["beside_bulk"]))
    lines += ["", "## In-process", ""]
    lines += [
        "| workload | what | batch | seq/s | tok/s | p50 ms | p95 ms | p99 ms | padding | / ceiling | other CPU |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for wname, inproc in report["inprocess"].items():
        ceiling = inproc["ceiling"]["seq_per_s"]
        rows = [("ONNX Runtime, best batch (ceiling)", inproc["ceiling"])]
        rows.append(("ONNX Runtime, one request at a time", inproc["one_at_a_time"]))
        served = inproc.get("served_batching")
        if served:
            rows.append((f"ONNX Runtime, the server's batches for {served['clients']} clients (mean)", served))
        side = inproc.get("side_by_side")
        if side:
            label = f"ONNX Runtime, {side['workers']} batches side by side (the server's workers), best batch"
            rows.append((label, side))
        torch = inproc.get("pytorch")
        if torch and "skipped" not in torch:
            rows.append((f"PyTorch eager ({torch['device']}, {torch['threads']} threads)", torch))
        for label, r in rows:
            lat = r["latency_ms"]
            lines.append(
                f"| {wname} | {label} | {_size(r['batch_size'])} | {fmt(r['seq_per_s'])} | {fmt(r['tok_per_s'], 0)} | "
                f"{fmt(lat['p50'])} | {fmt(lat['p95'])} | {fmt(lat['p99'])} | {_pct(r['padding_fraction'])} | "
                f"{r['seq_per_s'] / ceiling:.2f} | {fmt(r.get('other_cpu_cores'), 2)}{_mark(r)} |"
            )
        if torch and "skipped" in torch:
            lines.append(f"| {wname} | PyTorch eager: skipped ({torch['skipped']}) | | | | | | | | | |")
    lines += ["", "In-process latencies are per call (one batch). Text workloads include tokenisation."]
    for part, note in _IN_PROCESS_NOTES.items():
        if any(part in inproc for inproc in report["inprocess"].values()):
            lines[-1] += note
    lines.append("")
    for wname, inproc in report["inprocess"].items():
        after = inproc.get("ceiling_after")
        if after:
            lines.append(
                f"- {wname}: the ceiling measured again after the server runs: {fmt(after['seq_per_s'])} seq/s "
                f"at batch {after['batch_size']} ({after['drift']:+.0%} against the first measurement"
                + (f"; other processes took {after['other_cpu_cores']:.2f} cores *)" if after.get("disturbed") else ")")
            )
    lines.append("")
    lines += ["### Ceiling sweep (ONNX Runtime in-process, seq/s by batch size)", ""]
    sizes = sorted({r["batch_size"] for inproc in report["inprocess"].values() for r in inproc["sweep"]})
    lines += ["| workload | " + " | ".join(f"b={b}" for b in sizes) + " |", "| --- |" + " ---: |" * len(sizes)]
    for wname, inproc in report["inprocess"].items():
        by = {r["batch_size"]: r["seq_per_s"] for r in inproc["sweep"]}
        lines.append(f"| {wname} | " + " | ".join(fmt(by.get(b)) for b in sizes) + " |")
    lines += ["", "## Server over gRPC", ""]
    lines += [
        "| workload | batching | clients | seq/s | tok/s | p50 ms | p95 ms | p99 ms | / ceiling | padding "
        "| mean batch | server CPU | client CPU | other CPU | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for wname, inproc in report["inprocess"].items():
        ceiling = inproc["ceiling"]["seq_per_s"]
        for batching, runs in report["server"].items():
            for p in runs.get(wname, []):
                lat = p["latency_ms"]
                errors = errors_cell(p["errors"])
                lines.append(
                    f"| {wname} | {batching} | {p['concurrency']} | {fmt(p['seq_per_s'])} | {fmt(p['tok_per_s'], 0)} | "
                    f"{fmt(lat['p50'])} | {fmt(lat['p95'])} | {fmt(lat['p99'])} | {p['seq_per_s'] / ceiling:.2f} | "
                    f"{_pct(p['padding_fraction'])} | {fmt(p['mean_batch_size'])} | {fmt(p['server_cpu_cores'], 2)} | "
                    f"{fmt(p['client_cpu_cores'], 2)} | {fmt(p.get('other_cpu_cores'), 2)}{_mark(p)} | {errors} |"
                )
    lines += [
        "",
        "CPU columns are in cores busy over the measured window (the machine has "
        f"{machine['cores']}): the server process (with `--processes`, the supervisor and its server processes "
        "together), this load generator, and everything else on the machine "
        "(other processes: noise the figures carry). Latency is client-side, per request. Server seq/s is "
        "clients / mean request cycle (Little's law for a closed loop), which does not jump with the bursts in "
        "which batches complete; the plain count of completions in the window is `seq_per_s_counted` in "
        "report.json.",
        "",
    ]
    lines += _threads_section(report)
    lines += _http_section(report)
    lines += _one_client_section(report)
    lines += _beside_bulk_section(report)
    lines += memory_section(report.get("memory"))
    guard = s.get("guard")
    if guard and guard["retries"]:
        disturbed = _disturbed(report)
        lines += [
            f"A figure measured while other processes took more than {guard['max_other_cores']} cores was measured "
            f"again (up to {guard['retries']} times, after waiting up to {guard['quiet_wait_s']:.0f} s for quiet) and "
            "the least disturbed attempt kept; "
            + (
                f"{len(disturbed)} figures stayed above it, marked `*`: {', '.join(disturbed)}."
                if disturbed
                else "every figure above is within it."
            ),
            "",
        ]
    return "\n".join(lines)


def _threads_section(report: dict[str, Any]) -> list[str]:
    """The server's CPU per request by thread, beside the load generator's: where the cores went."""
    roles = ("event loop", "inference", "other", "tokenize", "grpc")
    rows = [
        (wname, batching, p)
        for batching, runs in report["server"].items()
        for wname, points in runs.items()
        for p in points
        if p.get("server_threads_ms_per_request")
    ]
    if not rows:
        return []
    lines = [
        "### Where the server's CPU goes (ms of CPU per request, by thread)",
        "",
        "| workload | batching | clients | " + " | ".join(roles) + " | server | client |",
        "| --- | --- | ---: |" + " ---: |" * (len(roles) + 2),
    ]
    for wname, batching, p in rows:
        by = p["server_threads_ms_per_request"]
        lines.append(
            f"| {wname} | {batching} | {p['concurrency']} | "
            + " | ".join(fmt(by.get(r), 2) for r in roles)
            + f" | {fmt(sum(by.values()), 2)} | {fmt(p['client_cpu_ms_per_request'], 2)} |"
        )
    lines += [
        "",
        "event loop: the main thread (gRPC's Python layer, the interceptors, validation, short texts' "
        "tokenisation, the batcher, the responses); inference: the thread that calls ONNX Runtime (padding "
        "included); other: ONNX Runtime's intra-op pool and the tokenizer's own threads; tokenize: the threads "
        "long texts are tokenised on; grpc: gRPC core's threads. client: this load generator, on the same cores.",
        "",
    ]
    return lines


def _floor_clause(lone: dict[str, Any], names: dict[str, str]) -> str:
    """The paired one-client line's floor: one client's p50 on the empty server (the protocol stack alone,
    idle on each call as long as the model computes one text) less that idle time, and how far the server's
    gap lies above it."""
    floors, above = lone.get("median_floor_ms") or {}, lone.get("median_above_floor_ms") or {}
    if not floors:
        return ""
    cpu = lone.get("median_server_cpu_ms_per_request") or {}
    # Reports before the empty server took the served front had grpc.aio's, whatever the server ran.
    front = "the lean gRPC front" if lone.get("empty_server_front", "grpc") == "lean" else "grpc.aio's gRPC front"
    return (
        f"; on an empty server (the same protocol stacks, {front} and HTTP, no pipeline nor model, each call "
        "answered after "
        f"{fmt(lone.get('empty_server_delay_ms'), 0)} ms idle, ONNX Runtime's one-text p50 in whole milliseconds), "
        "p50 less that, medians: "
        + ", ".join(
            f"{names.get(p, p)} {fmt(floors[p], 2)} ms ({fmt(cpu.get(EMPTY + p), 2)} ms of its CPU a call), "
            f"the server's gap **{above[p]:+.2f} ms** above it"
            for p in floors
        )
    )


def _one_client_section(report: dict[str, Any]) -> list[str]:
    """A lone client's latency by client, against ONNX Runtime's on one input at a time."""
    names = client_names(report)
    rows = {wname: w["one_client"] for wname, w in report["summary"].items() if "one_client" in w}
    if not rows or all(len(r["clients"]) == 1 for r in rows.values()):
        return []  # the gRPC table has it already
    lines = [
        "## One client",
        "",
        "| workload | server | client | p50 ms | - ONNX Runtime one at a time | p99 ms | client CPU ms/req |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for wname, r in rows.items():
        lines.append(
            f"| {wname} | | ONNX Runtime one input at a time, in process | {fmt(r['reference_p50_ms'], 2)} | | | |"
        )
        for name, c in r["clients"].items():
            lines.append(
                f"| {wname} | {r['batching']} | {names.get(name, name)} | {fmt(c['p50_ms'], 2)}{_mark(c)} | "
                f"{c['gap_ms']:+.2f} | {fmt(c['p99_ms'], 2)} | {fmt(c['client_cpu_ms_per_request'], 2)} |"
            )
    lines += [
        "",
        "One client sending its next input as soon as the last is answered, on the server HTTP is measured on. "
        f"{names['grpc']} is the load generator's client, which runs an event loop of its own; the synchronous "
        "stub (`--protocols` with grpc-sync) blocks in grpc core instead, as `mhaserve encode` and most Python "
        "callers do: where the two read alike, a lone call's time is not the client's. A single point each, "
        "measured minutes after the in-process figure: the paired check in the summary, when it ran, is the "
        "figure to quote.",
        "",
    ]
    return lines


def _alone_or_beside(n: str) -> str:
    return "alone" if n == "0" else f"beside {n}"


def _beside_bulk_line(mixed: dict[str, Any]) -> str:
    """The summary's line on queries beside indexing clients: a count whose measurement failed is said to have
    failed, not quoted (a p50 "beside 1" once came from queries alone, every bulk request refused)."""
    parts = [f"FAILED {_alone_or_beside(n)}: {v['failed']}" for n, v in mixed["median"].items() if v.get("failed")]
    med = {n: v for n, v in mixed["median"].items() if not v.get("failed")}
    if med:
        parts.append(
            "a query's p50 "
            + ", ".join(
                f"**{fmt(v['latency_ms']['p50'])} ms** {_alone_or_beside(n)}"
                + (f" ({errors_cell(v['errors'])} failed)" if v["errors"] else "")
                for n, v in med.items()
            )
            + f" (mean {', '.join(fmt(v['latency_ms']['mean']) for v in med.values())})"
        )
    bulk = [f"{fmt(v['bulk_texts_per_s'], 0)} beside {n}" for n, v in med.items() if v["bulk_texts_per_s"] is not None]
    if bulk:
        parts.append(f"the bulk clients' texts a second: {', '.join(bulk)}")
    if mixed.get("in_process"):
        parts.append(f"the queries alone replayed in process: {fmt(mixed['in_process']['latency_ms']['p50'])} ms")
    return (
        f"- **queries beside indexing clients** ({mixed['workload']} texts, {fmt(mixed['query_rate'], 0)} queries a "
        f"second at random times, {mixed['route']}, bulk clients of {mixed['bulk_inputs']} texts a request; medians of "
        f"{len(mixed['rounds'])} round(s)): " + "; ".join(parts)
    )


def _beside_bulk_section(report: dict[str, Any]) -> list[str]:
    """Queries at random times beside each count of bulk clients (beside.py)."""
    mixed = report.get("beside_bulk")
    if not mixed:
        return []
    lines = [
        f"## Queries beside indexing clients ({mixed['workload']} texts, {mixed['route']}, the {mixed['batching']} "
        "server)",
        "",
        "| bulk clients | query p50 ms | p95 ms | p99 ms | mean ms | bulk texts/s | queries answered / sent | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for n, v in mixed["median"].items():
        lat = v["latency_ms"]
        errors = errors_cell(v["errors"])
        failed = f" (FAILED: {v['failed']})" if v.get("failed") else ""
        lines.append(
            f"| {n}{' (queries alone)' if n == '0' else ''}{failed} | {fmt(lat['p50'])} | {fmt(lat['p95'])} | "
            f"{fmt(lat['p99'])} | {fmt(lat['mean'])} | {fmt(v['bulk_texts_per_s'], 0)} | {v['answered']} / "
            f"{v['queries']} | {errors} |"
        )
    replayed = mixed.get("in_process")
    if replayed:
        lat = replayed["latency_ms"]
        lines.append(
            f"| 0, in process (no server) | {fmt(lat['p50'])} | {fmt(lat['p95'])} | {fmt(lat['p99'])} | "
            f"{fmt(lat['mean'])} | - | {replayed['queries']} / {replayed['queries']} | - |"
        )
    lines += [
        "",
        f"Queries come at random times ({fmt(mixed['query_rate'], 0)} a second, Poisson), one text each, for "
        f"{fmt(mixed['seconds'], 0)} s beside each count of bulk clients, which send {mixed['bulk_inputs']} texts a "
        "request back to back, each on a connection of its own (both with `encoding_format` "
        f"{mixed['encoding_format']}, as the official OpenAI client asks). A query's latency runs from when it was "
        "due to its answer. Medians of the rounds, each measuring every count in turn, the next round starting one "
        "turn later; the queries and errors are the rounds' sums. Every client shares the load generator's one event "
        "loop, on the server's machine.",
        "",
    ]
    if replayed:
        lines += [
            "The row in process is a turn of the same rounds: ONNX Runtime in a child process of the bench, on every "
            "core, sent the queries the server was sent alone (the same texts at the same times), one text a run, "
            "tokenising counted, each timed from when it was due. It is the reference for a query that meets an idle "
            "server: on a machine whose cores idled meanwhile a run takes longer than one of a run back to back (the "
            "one-client figures), with no server in the way.",
            "",
        ]
    return lines


def _http_section(report: dict[str, Any]) -> list[str]:
    """The HTTP points beside the gRPC points of the same server, client count by client count."""
    http = report.get("http")
    rows = {wname: w["http"]["protocols"] for wname, w in report["summary"].items() if "http" in w}
    if not http or not rows:
        return []
    lines = [
        f"## Server over HTTP beside gRPC ({http['route']}, the {http['batching']} server)",
        "",
        "| workload | protocol | clients | seq/s | gRPC seq/s | / gRPC | p50 ms | gRPC p50 | p99 ms | gRPC p99 "
        "| client CPU ms/req | gRPC client CPU ms/req | server CPU | other CPU | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for wname, protocols in rows.items():
        for protocol, summary in protocols.items():
            points = _by_clients(http["protocols"][protocol][wname])
            for r in summary:
                p = points[r["clients"]]
                errors = errors_cell(p["errors"])
                lines.append(
                    f"| {wname} | {protocol} | {r['clients']} | {fmt(r['seq_per_s'])} | {fmt(r['grpc_seq_per_s'])} | "
                    f"{fmt(r['ratio'], 2)} | {fmt(r['p50_ms'])} | {fmt(r['grpc_p50_ms'])} | {fmt(r['p99_ms'])} | "
                    f"{fmt(r['grpc_p99_ms'])} | {fmt(r['client_cpu_ms_per_request'], 2)} | "
                    f"{fmt(r['grpc_client_cpu_ms_per_request'], 2)} | {fmt(p['server_cpu_cores'], 2)} | "
                    f"{fmt(p.get('other_cpu_cores'), 2)}{_mark(p)} | {errors} |"
                )
    lines += [
        "",
        "`http` asks for `encoding_format` float (JSON numbers), `http-base64` for base64 (what the official "
        "OpenAI Python client asks for). Each HTTP client holds one keep-alive HTTP/1.1 connection; the gRPC "
        "clients share one channel. The HTTP point is measured right after the gRPC point of the same server "
        "and client count. Client CPU per request is the load generator's own cost: it shares the machine with "
        "the server.",
        "",
    ]
    return lines


def _mib(kib: float | None, sign: bool = False) -> str:
    return "-" if kib is None else f"{kib / 1024:{'+' if sign else ''},.1f}"


def memory_section(mem: dict[str, Any] | None) -> list[str]:
    """The server's resident and peak memory per graph, after warm-up and after the run's requests (the report's
    `memory`, from memory.result); nothing when the memory was not measured."""
    if not mem:
        return []
    runs = mem["graphs"]
    first = next(iter(runs.values()), None)
    lines = ["## Server memory", "", f"**Verdict**: {mem['verdict']}.", ""]
    skipped = [f"- not measured: {graph}: {why}" for graph, why in mem["skipped"].items()]
    if first is None:
        return [*lines, *skipped, ""] if skipped else lines
    lines += [
        f"| graph | file MiB | RSS at start-up | RSS after warm-up | RSS after {first['requests']:,} requests | growth "
        "| of which in the second half | per 10k requests | peak after warm-up | peak at the end | peak growth "
        "| anon at the end | errors |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for graph, r in runs.items():
        s = r["summary"]
        errors = errors_cell(r["errors"])
        lines.append(
            f"| {graph} | {fmt(r['file_mib'])} | {_mib(r['start']['rss_kib'])} | {_mib(s['warm']['rss_kib'])} | "
            f"{_mib(s['end']['rss_kib'])} | **{_mib(s['growth_kib'], sign=True)}** | "
            f"{_mib(s['second_half_growth_kib'], sign=True)} | {_mib(s['slope_kib_per_10k'], sign=True)} | "
            f"{_mib(s['warm']['peak_kib'])} | {_mib(s['end']['peak_kib'])} | {_mib(s['peak_growth_kib'], sign=True)} | "
            f"{_mib(s['end']['anon_kib'])} | {errors} |"
        )
    lines += [
        "",
        f"MiB. Each graph served alone by a fresh `mhaserve serve` ({mem['batching']} batching, {first['provider']}), "
        f"sent the {first['workload']} workload by {first['clients']} closed-loop gRPC clients: first a warm-up of "
        f"{first['warmup_requests']:,} requests, then {first['requests']:,} more. RSS is VmRSS of /proc/<pid>/status "
        "(resident now), peak is VmHWM (the most it was ever resident), anon is RssAnon (heap and arenas, not "
        "mapped files); growth is from the warm-up to the end, and per 10k requests the least-squares slope of "
        f"the {len(first['samples'])} readings in between. Growth above {first['summary']['bound_mib']:g} MiB is "
        "called growth. Memory on a GPU is not in RSS.",
        "",
    ]
    for graph, r in runs.items():
        lines.append(f"- {graph}: RSS at each reading, MiB: " + ", ".join(_mib(x["rss_kib"]) for x in r["samples"]))
    lines += [*skipped, ""]
    return lines


COLOURS = {"arrival": "tab:orange", "length": "tab:blue", "http": "tab:green", "http-base64": "tab:purple"}


def _series(report: dict[str, Any], wname: str) -> list[tuple[str, str | None, str, list[dict[str, Any]]]]:
    """The server's lines in a workload's panel: (label, colour, marker, points), gRPC per policy, then HTTP."""
    out = [
        (f"gRPC, {batching} batching", COLOURS.get(batching), "o", runs[wname])
        for batching, runs in report["server"].items()
        if runs.get(wname)
    ]
    batching = (report.get("http") or {}).get("batching")
    out += [
        (f"{protocol}, {batching} batching", COLOURS.get(protocol), "^", runs[wname])
        for protocol, runs in _http_runs(report).items()
        if runs.get(wname)
    ]
    return out


def plots(report: dict[str, Any], out: Path) -> list[Path]:
    """throughput.png and latency.png: one panel per workload, one line per batching policy (gRPC) and per
    HTTP protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["inprocess"])
    paths = []

    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, wname in zip(axes[0], workloads, strict=True):
        inproc = report["inprocess"][wname]
        for label, colour, marker, pts in _series(report, wname):
            xs = [p["concurrency"] for p in pts]
            ax.plot(xs, [p["seq_per_s"] for p in pts], f"{marker}-", color=colour, label=f"server over {label}")
        ax.axhline(
            inproc["ceiling"]["seq_per_s"],
            color="k",
            ls="--",
            label=f"ceiling (ORT, batch {inproc['ceiling']['batch_size']})",
        )
        ax.axhline(inproc["one_at_a_time"]["seq_per_s"], color="grey", ls=":", label="ORT, one at a time")
        torch = inproc.get("pytorch")
        if torch and "skipped" not in torch:
            ax.axhline(
                torch["seq_per_s"], color="tab:red", ls="-.", label=f"PyTorch eager, batch {torch['batch_size']}"
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("sequences / s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{wname} workload: throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(f"{report['model']['name']} on {report['machine']['cores']} cores ({report['model']['provider']})")
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for ax, wname in zip(axes[0], workloads, strict=True):
        for label, colour, marker, pts in _series(report, wname):
            xs = [p["concurrency"] for p in pts]
            ax.plot(xs, [p["latency_ms"]["p50"] for p in pts], f"{marker}-", color=colour, label=f"{label} p50")
            ax.plot(xs, [p["latency_ms"]["p99"] for p in pts], f"{marker}--", color=colour, label=f"{label} p99")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("latency per request, ms")
        ax.set_title(f"{wname} workload: latency")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def failures(report: dict[str, Any]) -> list[str]:
    """The measurements of a run that failed, each as the report words it: a run with any exits 1 (run.main)."""
    mixed = report.get("beside_bulk") or {"median": {}}
    return [
        f"queries {_alone_or_beside(n)}{' bulk clients' if n != '0' else ''}: {v['failed']}"
        for n, v in mixed["median"].items()
        if v.get("failed")
    ]


def write(report: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    report["summary"] = summarize(report)
    report["failed"] = failures(report)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    return [out / "report.md", out / "report.json", *plots(report, out)]
