"""`mhaserve bench --quick` end to end on a tiny random model: the report's structure and that figures are
positive. No timings are asserted: they depend on the machine."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from mhaserve.loadtest.bench import options
from mhaserve.loadtest.bench.inprocess import SIDE_BY_SIDE_BATCHES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_bench_end_to_end(tiny_entry: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "mhaserve.cli", "bench", "--quick",
        "--repository", str(tiny_entry.parent.parent), "--model", "tiny", "--output", str(out),
        "--protocols", "grpc,grpc-sync,http,http-base64",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]

    for name in ("report.md", "report.json", "throughput.png", "latency.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((out / "report.json").read_text())

    assert report["model"]["name"] == "tiny"
    assert report["settings"]["quick"] is True
    concurrency = list(options.QUICK["concurrency"])
    assert report["settings"]["concurrency"] == concurrency
    assert report["workloads"]["short"]["inputs"] == options.QUICK["short_pool"]
    assert report["workloads"]["short"]["payload"] == "texts"
    for workload in ("fixed", "mixed", "short"):
        inproc = report["inprocess"][workload]
        for part in ("ceiling", "one_at_a_time", "pytorch"):
            r = inproc[part]
            assert r["seq_per_s"] > 0 and r["tok_per_s"] > 0, (workload, part)
            assert r["latency_ms"]["p50"] > 0
        assert inproc["one_at_a_time"]["batch_size"] == 1
        # The length policy's batches for the clients nearest the headline's 32, run in process.
        served = inproc["served_batching"]
        assert served["clients"] == max(concurrency) and served["seq_per_s"] > 0
        assert 1 <= served["batch_size"] <= served["clients"] and served["max_padding"] == 0.1
        assert inproc["ceiling_after"]["seq_per_s"] > 0
        assert inproc["ceiling"]["seq_per_s"] == max(r["seq_per_s"] for r in inproc["sweep"])
        for batching in ("arrival", "length"):
            points = report["server"][batching][workload]
            assert [p["concurrency"] for p in points] == concurrency
            for p in points:
                assert p["completed"] > 0 and p["seq_per_s"] > 0 and p["tok_per_s"] > 0
                assert 0 < p["latency_ms"]["p50"] <= p["latency_ms"]["p99"]
                assert p["errors"] == {}
                assert p["mean_batch_size"] >= 1 and 0 <= p["padding_fraction"] < 1
                assert p["client_cpu_cores"] > 0
                # The server's threads are told apart by their OS names (service/threads.py).
                threads = p["server_threads_ms_per_request"]
                assert threads["event loop"] > 0 and threads["inference"] > 0, threads
        # Batches side by side as the server's workers compute them: with its default workers on this host's cores.
        layout = options.side_by_side(None, [], env={}, device="auto")
        if layout is None:
            assert "side_by_side" not in inproc
        else:
            side = inproc["side_by_side"]
            assert (side["workers"], side["overlap_threads"]) == (layout["workers"], layout["overlap_threads"])
            assert side["seq_per_s"] == max(r["seq_per_s"] for r in side["sweep"]) > 0
            assert side["batch_size"] in SIDE_BY_SIDE_BATCHES and side["padding_fraction"] < 1
            assert report["summary"][workload]["side_by_side"]["ratio"] > 0
        summary = report["summary"][workload]
        assert summary["ceiling_seq_per_s"] > 0
        assert summary["served_batching"]["ratio"] > 0
        assert summary["length"]["ratio"] > 0 and summary["length_over_arrival"] > 0
        assert summary["length"]["one_client_p50_ms"] > 0 and summary["batch1_p50_ms"] > 0

    # HTTP beside gRPC: the text workloads, on the length policy's server, at every client count.
    http = report["http"]
    assert http["batching"] == "length" and set(http["protocols"]) == {"http", "http-base64"}
    for protocol, runs in http["protocols"].items():
        assert set(runs) == {"mixed", "short"}, protocol  # token ids (fixed) are not sent over HTTP
        for workload, points in runs.items():
            assert [p["concurrency"] for p in points] == concurrency
            for p in points:
                assert p["protocol"] == protocol and p["errors"] == {}, (protocol, workload, p["errors"])
                assert p["completed"] > 0 and p["seq_per_s"] > 0 and p["tok_per_s"] > 0
                assert p["client_cpu_ms_per_request"] > 0
            rows = report["summary"][workload]["http"]["protocols"][protocol]
            assert [r["clients"] for r in rows] == concurrency
            assert all(r["ratio"] > 0 and r["grpc_seq_per_s"] > 0 for r in rows)
    assert "http" not in report["summary"]["fixed"]
    paired = report["paired"]
    # The replay of the server's batches runs once per workload in the in-process step, not again in the
    # fixed workload's paired turns; the short workload's paired rounds replay it once each.
    replays = run.stderr.count("the server's batches for")  # progress lines
    assert replays == 3 + options.QUICK["paired"], replays
    assert paired["clients"] == 32 and len(paired["pairs"]) == options.QUICK["paired"]
    assert all(p["ceiling_seq_per_s"] > 0 and p["server_seq_per_s"] > 0 for p in paired["pairs"])
    assert report["summary"]["fixed"]["paired_median_ratio"] == paired["median_ratio"] > 0
    # The short workload's split in turns: the server's batches, gRPC and HTTP against the ceiling.
    short = report["paired_short"]
    assert short["workload"] == "short" and short["batching"] == "length" and short["clients"] == 32
    assert len(short["rounds"]) == options.QUICK["paired"]
    names = {"served/ceiling", "grpc/ceiling", "grpc/served", "http/ceiling", "http/served"}
    if "side_by_side" in report["inprocess"]["short"]:  # and at the sweep's best batch size in every round
        names |= {"side/ceiling", "grpc/side", "http/side"}
    for r in short["rounds"]:
        assert sorted(r["order"]) == ["grpc", "http", "in process"]
        assert r["served_clients"] == 32  # the batches of the clients served, whatever the sweep's counts
        assert set(r["ratios"]) == names and all(v > 0 for v in r["ratios"].values()), r
        seq = r["seq_per_s"]
        assert r["ratios"]["grpc/served"] == seq["grpc"] / seq["served"]
        assert r["ratios"]["served/ceiling"] == seq["served"] / seq["ceiling"]
        if "side" in seq:
            assert r["ratios"]["http/side"] == seq["http"] / seq["side"]
    assert report["summary"]["short"]["paired"] == {"rounds": len(short["rounds"]), **short["median"]}

    # One client from a synchronous stub beside the load generator's, on every workload, and every client's
    # p50 against ONNX Runtime's on one input at a time.
    lone = report["lone"]
    assert lone["batching"] == "length" and lone["protocol"] == "grpc-sync"
    assert set(lone["points"]) == {"fixed", "mixed", "short"}
    for workload, p in lone["points"].items():
        assert p["protocol"] == "grpc-sync" and p["concurrency"] == 1 and p["errors"] == {}, (workload, p["errors"])
        assert p["completed"] > 0 and 0 < p["latency_ms"]["p50"] <= p["latency_ms"]["p99"]
        assert p["client_cpu_ms_per_request"] > 0 and p["server_threads_ms_per_request"]["inference"] > 0
        one = report["summary"][workload]["one_client"]
        clients = ["grpc", "grpc-sync"] + (["http", "http-base64"] if workload != "fixed" else [])
        assert one["batching"] == "length" and list(one["clients"]) == clients
        reference = report["inprocess"][workload]["one_at_a_time"]["latency_ms"]["p50"]
        assert one["reference_p50_ms"] == reference
        assert one["clients"]["grpc-sync"]["p50_ms"] == p["latency_ms"]["p50"]
        assert one["clients"]["grpc"]["p50_ms"] == report["server"]["length"][workload][0]["latency_ms"]["p50"]
        assert all(c["gap_ms"] == c["p50_ms"] - reference for c in one["clients"].values())
    # ... and in turns with ONNX Runtime one text at a time, round by round, on the short texts, beside one
    # client of gRPC and of HTTP on the empty server (the protocol stacks alone): the floor under the gap.
    paired_lone = report["paired_lone"]
    assert paired_lone["workload"] == "short" and len(paired_lone["rounds"]) == options.QUICK["paired"]
    assert paired_lone["empty_server_front"] == "lean"  # the served front's (the default) floor
    servers = ["grpc", "grpc-sync", "http"]
    for r in paired_lone["rounds"]:
        assert sorted(r["order"]) == ["empty grpc", "empty http", *servers, "in process"], r["order"]
        assert all(v > 0 for v in r["p50_ms"].values())
        assert r["gap_ms"] == {p: r["p50_ms"][p] - r["p50_ms"]["in process"] for p in servers}
        # The empty server idles on each call as long as ONNX Runtime computes one text, measured by the sweep.
        delay = paired_lone["empty_server_delay_ms"]
        assert delay == math.floor(report["inprocess"]["short"]["one_at_a_time"]["latency_ms"]["p50"])
        assert r["floor_ms"] == {p: r["p50_ms"]["empty " + p] - delay for p in ("grpc", "http")}
        assert all(r["p50_ms"]["empty " + p] >= delay for p in ("grpc", "http"))
        assert r["above_floor_ms"] == {p: r["gap_ms"][p] - r["floor_ms"][p] for p in ("grpc", "http")}
        # The empty server's CPU a call is its own, measured like the server's, and less than the server's.
        cpu = r["server_cpu_ms_per_request"]
        assert set(cpu) == {"empty grpc", "empty http", *servers}
        assert 0 < cpu["empty grpc"] < cpu["grpc"] and 0 < cpu["empty http"] < cpu["http"], cpu
    summary_lone = report["summary"]["short"]["paired_one_client"]
    assert summary_lone == {
        "rounds": len(paired_lone["rounds"]),
        "gap_ms": paired_lone["median_gap_ms"],
        "empty_server_p50_ms": paired_lone["median_floor_ms"],
        "above_empty_server_ms": paired_lone["median_above_floor_ms"],
    }
    assert "paired_one_client" not in report["summary"]["mixed"]
    # Queries at random times beside bulk clients of 64 texts a request, on the short texts over HTTP.
    mixed_traffic = report["beside_bulk"]
    assert mixed_traffic["workload"] == "short" and mixed_traffic["batching"] == "length"
    assert len(mixed_traffic["rounds"]) == options.QUICK["paired"]
    counts = [str(n) for n in options.QUICK["beside_bulk"]]
    # The queries alone are replayed in process too, a turn of the same rounds.
    assert mixed_traffic["rounds"][0]["order"] == [*counts, "in process"]
    assert set(mixed_traffic["median"]) == set(counts)
    replayed = mixed_traffic["in_process"]
    assert replayed["queries"] == mixed_traffic["median"]["0"]["queries"] > 0
    assert 0 < replayed["latency_ms"]["p50"] <= replayed["latency_ms"]["p99"]
    for n, m in mixed_traffic["median"].items():
        assert m["errors"] == {} and m["answered"] == m["queries"] > 0, (n, m)
        assert 0 < m["latency_ms"]["p50"] <= m["latency_ms"]["p99"]
        assert (m["bulk_texts_per_s"] is None) == (n == "0")
        if n != "0":
            assert m["bulk_texts_per_s"] > 0
    assert report["summary"]["short"]["beside_bulk"] == {
        "rounds": 1,
        "by_bulk_clients": mixed_traffic["median"],
        "alone_in_process": replayed,
    }
    assert "beside_bulk" not in report["summary"]["mixed"]
    assert report["workloads"]["fixed"]["min_tokens"] == report["workloads"]["fixed"]["max_tokens"] == 32

    # The server's memory: every CPU graph the entry has (fp16 is a GPU graph), each from a fresh server.
    mem = report["memory"]
    assert list(mem["graphs"]) == ["fp32", "optimized", "optimized-cpu", "int8"] and mem["skipped"] == {}
    assert mem["verdict"].startswith(("no growth", "GROWTH"))
    for graph, r in mem["graphs"].items():
        assert r["errors"] == {} and r["requests"] == options.QUICK["rss_requests"], graph
        assert r["samples"][0]["requests"] == 0 and r["samples"][-1]["requests"] == r["requests"]
        assert r["workload"] == "short" and r["clients"] == 32 and r["provider"] == "CPUExecutionProvider"
        assert r["file_mib"] > 0 and 0 < r["start"]["rss_kib"] <= r["summary"]["end"]["peak_kib"]

    md = (out / "report.md").read_text()
    assert "## Server memory" in md and "| optimized |" in md
    assert f"(int8 products on {report['machine']['int8_kernel']})" in md  # the int8 graph's figures hang on it
    for heading in (
        "## Summary",
        "## In-process",
        "## Server over gRPC",
        "### Where the server's CPU goes",
        "## Server over HTTP beside gRPC",
        "Ceiling",
        "paired check, short workload",
        "## One client",
        "paired check, one client, short workload",
        # The default server's front, the lean one, on the empty server too: the floor is the served front's.
        "on an empty server (the same protocol stacks, the lean gRPC front and HTTP, no pipeline nor model, each "
        "call answered after",
        "gRPC (synchronous stub)",
        "## Queries beside indexing clients (short texts, POST /v1/embeddings, the length server)",
        "queries beside indexing clients",
        "| 0, in process (no server) |",
        "the queries alone replayed in process",
    ):
        assert heading in md
    assert report["command"].startswith("mhaserve bench ") and "--quick" in report["command"]


@pytest.mark.slow
def test_memory_only_skips_the_graphs_it_cannot_measure_and_says_why(tmp_path: Path) -> None:
    out = tmp_path / "memory"
    # --quick's own tiny model has fp32 and the fused graphs only (the suite's tiny_entry has int8 too).
    cmd = [
        sys.executable, "-m", "mhaserve.cli", "bench", "--quick", "--memory-only", "--output", str(out),
        "--graphs", "int8,optimized", "--rss-requests", "200",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "memory" and "--memory-only" in report["command"]
    mem = report["memory"]
    assert list(mem["graphs"]) == ["optimized"] and mem["graphs"]["optimized"]["requests"] == 200
    assert mem["skipped"] == {"int8": "the entry has no int8 graph (it has fp32, optimized, optimized-cpu)"}
    assert (out / "server-memory-optimized.log").exists() and not (out / "server-memory-fp32.log").exists()
    md = (out / "report.md").read_text()
    assert "## Server memory" in md and "- not measured: int8: the entry has no int8 graph" in md
    assert "## Server over gRPC" not in md  # the sweep did not run


def test_command_line_reproduces_the_options() -> None:
    import argparse

    p = argparse.ArgumentParser()
    options.add_arguments(p)
    args = p.parse_args(["--concurrency", "1,32", "--server-arg=--max-wait-ms=5", "--no-torch"])
    assert options.command_line(args) == "mhaserve bench --concurrency 1,32 --no-torch --server-arg=--max-wait-ms=5"
    resolved = options.resolve(args)
    assert resolved["concurrency"] == (1, 32) and resolved["duration"] == options.FULL["duration"]
    with pytest.raises(SystemExit):
        p.parse_args(["--concurrency", "0"])
    assert options.resolve(args)["protocols"] == options.DEFAULT_PROTOCOLS
    args = p.parse_args(["--protocols", "grpc", "--workloads", "short"])
    assert options.command_line(args) == "mhaserve bench --workloads short --protocols grpc"
    with pytest.raises(SystemExit):  # gRPC is the reference every other figure is compared with
        p.parse_args(["--protocols", "http"])
    args = p.parse_args(["--memory-only", "--graphs", "fp32,int8", "--rss-requests", "100000"])
    assert options.command_line(args) == "mhaserve bench --rss-requests 100000 --graphs fp32,int8 --memory-only"
    assert options.resolve(p.parse_args([]))["rss_requests"] == options.FULL["rss_requests"]
    # a zero is an option given, not an option left out
    args = p.parse_args(["--retries", "0", "--rss-requests", "0", "--seed", "0"])
    assert options.command_line(args) == "mhaserve bench --rss-requests 0 --retries 0"
    args = p.parse_args(["--beside-bulk", "none", "--query-rate", "20"])
    assert options.command_line(args) == "mhaserve bench --beside-bulk none --query-rate 20.0"
    assert options.resolve(args)["beside_bulk"] == () and options.resolve(p.parse_args([]))["beside_bulk"] == (0, 1, 2)
    assert p.parse_args(["--beside-bulk", "0,4"]).beside_bulk == (0, 4)
    bad_args = (
        ["--graphs", "fp8"],
        ["--rss-requests", "-1"],
        ["--paired", "-1"],
        ["--models", "a"],
        ["--models", "a,a"],
        ["--models", "a,b", "--memory-only"],  # two different runs: once exit 1, after the parse
        ["--duration", "-1"],  # accepted once: the run started and its stages failed
        ["--duration", "nan"],
        ["--min-time", "0"],
        # each of these ran, and ended in a traceback from the in-process stage or a flood of retries
        ["--fixed-pool", "0"],
        ["--short-pool", "0"],
        ["--torch-batch-size", "0"],
        ["--fixed-tokens", "0"],
        ["--threads", "-2"],
        ["--retries", "-1"],
        ["--max-other-cpu", "-1"],
        ["--quiet-wait", "-1"],
        ["--beside-bulk", "-1"],
        ["--beside-bulk", "1,1"],
        ["--beside-bulk", "one"],
        ["--query-rate", "0"],
    )
    for bad in bad_args:
        with pytest.raises(SystemExit):
            p.parse_args(bad)


@pytest.mark.parametrize(
    ("server_arg", "message"),
    [
        ("--server-arg=--max-wait-ms=abc", "argument --max-wait-ms: invalid"),
        ("--server-arg=--inference-workers=0", "--server-arg: --inference-workers must be > 0, got 0"),
        ("--server-arg=--bogus", "--server-arg: not a flag of mhaserve serve: --bogus"),
        # the bench sets these itself: once overridden without a word, or served another model than it measured
        ("--server-arg=--port=50052", "--server-arg: --port: set by the bench itself"),
        ("--server-arg=--model=other", "--server-arg: --model: set by the bench itself"),
    ],
)
def test_server_args_are_read_before_the_run(server_arg: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused when the server started, a typo cost the in-process stage's minutes before it."""
    from mhaserve.cli.main import main

    with contextlib.suppress(SystemExit):
        assert main(["bench", "--no-torch", "--repository", "/nonexistent/repo", server_arg]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workloads", "fixed", "--protocols", "grpc,http"], "--protocols http: HTTP is measured on the workloads"),
        (["--concurrency", "32", "--protocols", "grpc,grpc-sync"], "--protocols grpc-sync: the synchronous stub is"),
        (["--workloads", "fixed,mixed", "--beside-bulk", "0,1"], "--beside-bulk 0,1: the queries and the bulk clients"),
        (["--memory-only", "--beside-bulk", "1"], "--beside-bulk: measured by the sweep, not by a --memory-only run"),
    ],
)
def test_a_protocol_the_run_would_not_measure_is_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once skipped without a word: the report had no row for it."""
    from mhaserve.cli.main import main

    assert main(["bench", "--no-torch", "--repository", "/nonexistent/repo", *flags]) == 2
    assert message in capsys.readouterr().err


def test_report_says_how_the_server_split_its_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # The "Threads" line once said "all cores" for a server run with --inference-workers=2, whose
    # workers each had half of them.
    from mhaserve.loadtest.bench.options import server_threads

    monkeypatch.setattr("mhaserve.loadtest.bench.options.available_cpus", lambda: 2)
    one = ["--inference-workers=1"]
    assert server_threads(None, one, env={}) == "all cores (server default)"
    assert server_threads(2, one, env={}) == "2 per batch"
    two = ["--inference-workers=2"]
    assert server_threads(None, two, env={}) == "the cores split between 2 inference workers (server default)"
    assert server_threads(None, [*two, "--intra-op-threads=1"], env={}) == "1 per batch, 2 inference workers"
    # the server inherits the bench's environment; a flag passed through --server-arg wins over it
    assert server_threads(None, [], env={"MHASERVE_INFERENCE_WORKERS": "3"}).startswith("the cores split between 3")
    assert server_threads(None, two, env={"MHASERVE_INFERENCE_WORKERS": "3"}).startswith("the cores split between 2")
    assert server_threads(None, one, env={"MHASERVE_INTRA_OP_THREADS": "1"}) == "1 per batch"
    # Unset, the server picks its workers for the device and its cores (--inference-workers auto): on a CPU of
    # two cores, two, whatever the graph; on one core, or on CUDA, one.
    assert server_threads(None, [], env={}, device="cpu").startswith("the cores split between 2")
    assert server_threads(None, ["--graph=int8"], env={}, device="cpu").startswith("the cores split between 2")
    assert server_threads(None, [], env={"MHASERVE_INFERENCE_WORKERS": "1"}, device="cpu") == (
        "all cores (server default)"
    )
    assert server_threads(None, [], env={}, device="cuda") == "all cores (server default)"
    monkeypatch.setattr("mhaserve.loadtest.bench.options.available_cpus", lambda: 1)
    assert server_threads(None, [], env={}, device="cpu") == "all cores (server default)"


def test_batches_side_by_side_are_laid_out_as_the_server_splits_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process reference of batches computed side by side exists where the server computes several at
    once on a CPU with its cores split between the workers, with the server's split; nowhere else."""
    from mhaserve.loadtest.bench.options import side_by_side

    monkeypatch.setattr("mhaserve.loadtest.bench.options.available_cpus", lambda: 2)
    assert side_by_side(None, [], env={}, device="cpu") == {"workers": 2, "overlap_threads": 1}
    assert side_by_side(None, [], env={"MHASERVE_INFERENCE_WORKERS": "1"}, device="cpu") is None
    assert side_by_side(None, ["--inference-workers=1"], env={}, device="cpu") is None
    assert side_by_side(None, [], env={}, device="cuda") is None
    assert side_by_side(2, [], env={}, device="cpu") is None  # fixed threads: no overlap session
    assert side_by_side(None, ["--intra-op-threads=1"], env={}, device="cpu") is None
    assert side_by_side(None, ["--processes=2"], env={}, device="cpu") is None
    assert side_by_side(None, ["--inference-workers=x"], env={}, device="cpu") is None
    monkeypatch.setattr("mhaserve.loadtest.bench.options.available_cpus", lambda: 16)
    assert side_by_side(None, ["--inference-workers=4"], env={}, device="cpu") == {"workers": 4, "overlap_threads": 4}


def test_the_empty_server_runs_the_front_the_server_is_told() -> None:
    from mhaserve.loadtest.bench.options import server_front

    assert server_front([], env={}) == "lean"  # the server's default
    assert server_front([], env={"MHASERVE_GRPC_FRONT": "grpc"}) == "grpc"
    assert server_front(["--grpc-front=Lean"], env={"MHASERVE_GRPC_FRONT": "grpc"}) == "lean"  # the flag wins
    # The flag and its value as two --server-arg, as the server reads them too (a boolean flag takes none).
    assert server_front(["--reuse-port", "--grpc-front", "grpc", "--max-wait-ms=2"], env={}) == "grpc"
    with pytest.raises(ValueError, match="--grpc-front 'aio' is not one of grpc, lean"):
        server_front(["--grpc-front=aio"], env={})


def test_report_says_how_many_server_processes_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhaserve.loadtest.bench.options import server_processes, server_threads

    assert server_processes([], env={}) == 1
    assert server_processes(["--processes=3"], env={"MHASERVE_PROCESSES": "2"}) == 3
    assert server_processes([], env={"MHASERVE_PROCESSES": "2"}) == 2
    with pytest.raises(ValueError, match="--processes 'x' is not a number"):
        server_processes(["--processes=x"], env={})
    # Each process sizes its auto workers by its share: 16 cores over 2 processes is 8 each, so 4 workers.
    monkeypatch.setattr("mhaserve.loadtest.bench.options.available_cpus", lambda: 16)
    assert server_threads(None, ["--processes=2"], env={}, device="cpu") == (
        "the cores split between 4 inference workers (server default), in each of 2 server processes "
        "(sharing the cores: a batch alone on all of them)"
    )
    # With the threads fixed (or on a GPU), each process is pinned to its share instead.
    assert server_threads(None, ["--processes=2", "--intra-op-threads=1"], env={}, device="cpu").endswith(
        "in each of 2 server processes (each pinned to its share of the cores)"
    )
    assert server_threads(None, ["--processes=2"], env={}, device="cuda").endswith(
        "(each pinned to its share of the cores)"
    )


@pytest.mark.parametrize("mode", [[], ["--models", "a,b"], ["--memory-only"]], ids=["sweep", "models", "memory"])
def test_an_output_that_cannot_be_a_folder_is_one_line_before_the_run(
    mode: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--output FILE` or a path through a file ended in a FileExistsError or NotADirectoryError traceback."""
    from mhaserve.cli.main import main

    file = tmp_path / "report"
    file.write_text("")
    for output, why in [(file, "a file of that name is there"), (file / "x", "Not a directory")]:
        assert main(["bench", "--no-torch", "--repository", "/nonexistent/repo", *mode, "--output", str(output)]) == 1
        err = capsys.readouterr().err
        assert err == f"mhaserve bench: error: cannot make the results folder {output}: {why}\n"
