"""`mhaserve bench --quick` end to end on a tiny random model: the report's structure and that figures are
positive. No timings are asserted: they depend on the machine."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from mhaserve.loadtest.bench import options
from mhaserve.loadtest.bench.inprocess import SIDE_BY_SIDE_BATCHES
from mhaserve.service.settings import env_var, flag
from tests.security import conftest as security
from tests.security.conftest import Pki

ROOT = Path(__file__).resolve().parents[2]
pki = security.pki


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
        ("--server-arg=--inference-workers=0", "the bench's server: --inference-workers must be > 0, got 0"),
        ("--server-arg=--bogus", "--server-arg: not a flag of mhaserve serve: --bogus"),
        # the bench sets these itself: once overridden without a word, or served another model than it measured
        ("--server-arg=--port=50052", "--server-arg: --port: set by the bench itself"),
        # its clients dial 127.0.0.1: it waited 3 minutes for a server serving on ::1, then failed
        ("--server-arg=--host=::1", "--server-arg: --host: set by the bench itself"),
        ("--server-arg=--model=other", "--server-arg: --model: set by the bench itself"),
    ],
)
def test_server_args_are_read_before_the_run(server_arg: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused when the server started, a typo cost the in-process stage's minutes before it."""
    from mhaserve.cli.main import main

    with contextlib.suppress(SystemExit):
        assert main(["bench", "--no-torch", "--repository", "/nonexistent/repo", server_arg]) == 2
    assert message in capsys.readouterr().err


def test_a_server_variable_is_named_as_the_servers_not_as_a_server_arg(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MHASERVE_GRPC_FRONT=nope was reported as "--server-arg: MHASERVE_GRPC_FRONT ...", a flag never given."""
    from mhaserve.cli.main import main

    monkeypatch.setenv("MHASERVE_GRPC_FRONT", "nope")
    with contextlib.suppress(SystemExit):
        assert main(["bench", "--no-torch", "--repository", "/nonexistent/repo"]) == 2
    err = capsys.readouterr().err
    assert "the bench's server: MHASERVE_GRPC_FRONT must be one of grpc, lean" in err and "--server-arg" not in err


def test_the_servers_model_variable_is_not_read_as_the_bench_names_the_model_itself(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bench starts its servers with --model, which wins over MHASERVE_MODEL: a value there the server would
    refuse never reaches it, and the bench must not refuse it either."""
    from mhaserve.cli.main import main

    monkeypatch.setenv("MHASERVE_MODEL", "Bad/Name")
    with contextlib.suppress(SystemExit):
        main(["bench", "--no-torch", "--repository", "/nonexistent/repo"])
    err = capsys.readouterr().err
    assert "/nonexistent/repo" in err and "MHASERVE_MODEL" not in err, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--workloads", "fixed", "--protocols", "grpc,http"],
            "--protocols http: HTTP is measured on the workloads sent as text (mixed, short), and --workloads fixed "
            "has none (its token ids are sent over gRPC alone): add mixed or short to --workloads, or leave http out "
            "of --protocols",
        ),
        (
            ["--workloads", "fixed", "--protocols", "grpc,http-base64,grpc-sync,http"],
            "--protocols http-base64,http: HTTP is measured on the workloads sent as text (mixed, short), and "
            "--workloads fixed has none (its token ids are sent over gRPC alone): add mixed or short to --workloads, "
            "or leave http-base64,http out of --protocols",
        ),
        (["--concurrency", "32", "--protocols", "grpc,grpc-sync"], "--protocols grpc-sync: the synchronous stub is"),
        (
            ["--workloads", "fixed,mixed", "--beside-bulk", "0,1"],
            "--beside-bulk 0,1: the queries and the bulk clients send the short workload's texts, and --workloads "
            "fixed,mixed has none: add short to --workloads, or give --beside-bulk none",
        ),
        (  # the test's runs all have --no-torch
            ["--torch-batch-size", "16"],
            "--torch-batch-size 16: the PyTorch eager baseline is measured in batches of that size, and --no-torch "
            "skips it: leave out one of them",
        ),
        (["--memory-only", "--beside-bulk", "1"], "--beside-bulk: not read by a --memory-only run"),
        # Each says what to do instead, as the others do.
        (
            ["--graphs", "int8", "--rss-requests", "0"],
            "--graphs int8: the sweep measures the server's memory of each graph after --rss-requests requests, and "
            "--rss-requests 0 skips it: give --rss-requests above 0, or leave --graphs out",
        ),
        (
            ["--beside-bulk", "none", "--query-rate", "5"],
            "--query-rate 5: the queries beside bulk clients are sent by the --beside-bulk step, and "
            "--beside-bulk none skips it: give --beside-bulk counts of bulk clients (0: the queries alone), or "
            "leave --query-rate out",
        ),
        (
            ["--workloads", "fixed", "--query-rate", "5"],
            "--query-rate 5: the queries beside bulk clients send the short workload's texts, and --workloads fixed "
            "has none: add short to --workloads, or leave --query-rate out",
        ),
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


def _bench(*flags: str) -> int:
    """`mhaserve bench` with these flags (no PyTorch): its exit status."""
    from mhaserve.cli.main import main

    try:
        status = main(["bench", "--no-torch", *flags])
    except SystemExit as e:  # argparse's own usage errors
        status = int(e.code or 0)
    return status


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    options.add_arguments(p)
    return p


@pytest.mark.parametrize("flags", [["--workloads", "fixed"], ["--quick", "--workloads", "fixed"]])
def test_the_default_protocols_measure_what_the_workloads_allow(
    flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's `--workloads fixed` was refused at once for `--protocols http`, never given: the default is now
    gRPC alone where no workload is sent as text, HTTP beside it where one is."""
    status = _bench("--repository", "/nonexistent/repo", "--output", str(tmp_path / "out"), *flags)
    err = capsys.readouterr().err
    assert status == 1 and "--protocols" not in err, err  # past the options: the missing repository stops it
    assert options.resolve(_parser().parse_args(flags))["protocols"] == ("grpc",)
    assert options.resolve(_parser().parse_args([*flags, "--workloads", "fixed,short"]))["protocols"] == (
        "grpc",
        "http",
    )
    # Given, it is still refused when it would measure nothing (test_a_protocol_the_run_would_not_measure_is_refused).


KEYS = "KEYS"  # stands for a keys file the test writes


@pytest.mark.parametrize(
    ("env", "flags", "named"),
    [
        ({"MHASERVE_API_KEYS": "secret"}, [], "MHASERVE_API_KEYS"),
        ({"MHASERVE_API_KEYS_FILE": KEYS}, [], "MHASERVE_API_KEYS_FILE"),
        ({}, [f"--server-arg=--api-keys-file={KEYS}"], "--server-arg=--api-keys-file"),
        # Admin keys alone turn authentication on too (service/auth.py: Keys.enabled).
        ({"MHASERVE_ADMIN_KEYS": "secret"}, [], "MHASERVE_ADMIN_KEYS"),
        ({"MHASERVE_ADMIN_KEYS_FILE": KEYS}, [], "MHASERVE_ADMIN_KEYS_FILE"),
        ({}, [f"--server-arg=--admin-keys-file={KEYS}"], "--server-arg=--admin-keys-file"),
    ],
)
def test_a_server_with_api_keys_is_refused_before_the_run(
    env: dict[str, str],
    flags: list[str],
    named: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The server inherits the bench's environment; with keys it refused every call of the bench's clients, which
    send none: a grpc UNAUTHENTICATED traceback minutes into the run."""
    keys = tmp_path / "keys"
    keys.write_text("secret\n")
    for name, value in env.items():
        monkeypatch.setenv(name, str(keys) if value == KEYS else value)
    flags = [f.replace(KEYS, str(keys)) for f in flags]
    status = _bench("--repository", "/nonexistent/repo", "--output", str(tmp_path / "out"), *flags)
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"mhaserve bench: error: {named}: the bench's clients send no API key" in err


@pytest.mark.parametrize("how", ["env", "flags"])
def test_a_server_with_tls_is_refused_before_the_run(
    how: str, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bench's clients speak plaintext gRPC and HTTP (grpc.insecure_channel, transports.HttpConnection)."""
    flags = []
    for name, path in (("tls_cert", pki.server_cert), ("tls_key", pki.server_key)):
        if how == "env":
            monkeypatch.setenv(env_var(name), str(path))
        else:
            flags.append(f"--server-arg={flag(name)}={path}")
    status = _bench("--repository", "/nonexistent/repo", "--output", str(tmp_path / "out"), *flags)
    err = capsys.readouterr().err
    assert status == 2, err
    named = "MHASERVE_TLS_CERT, MHASERVE_TLS_KEY" if how == "env" else "--server-arg=--tls-cert, --server-arg=--tls-key"
    assert f"mhaserve bench: error: {named}: the bench's clients speak plaintext" in err


def test_a_server_setting_from_the_environment_is_read_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MHASERVE_GRPC_FRONT=nope was read only by the paired one-client rounds, after the whole sweep: a
    ValueError traceback."""
    monkeypatch.setenv("MHASERVE_GRPC_FRONT", "nope")
    status = _bench("--repository", "/nonexistent/repo", "--output", str(tmp_path / "out"))
    err = capsys.readouterr().err
    assert status == 2 and "MHASERVE_GRPC_FRONT" in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="MHASERVE_GRPC_FRONT 'nope' is not one of grpc, lean"):
        options.server_front([], env={"MHASERVE_GRPC_FRONT": "nope"})


def test_bulk_requests_the_server_would_refuse_are_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bulk clients send 64 texts a request: a server that takes fewer refused every one of them."""
    flags = ["--beside-bulk", "0,1", "--server-arg=--max-client-batch-size=8"]
    status = _bench("--repository", "/nonexistent/repo", "--output", str(tmp_path / "out"), *flags)
    err = capsys.readouterr().err
    assert status == 2 and "--beside-bulk 0,1: the bulk clients send 64 texts a request" in err, err
    assert "--max-client-batch-size 8" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--models", "a,b", "--protocols", "grpc,http"], "--protocols: not read by a --models run"),
        (["--models", "a,b", "--grpc-client", "h2"], "--grpc-client: not read by a --models run"),
        (["--models", "a,b", "--model", "a", "--paired", "2"], "--paired, --model: not read by a --models run"),
        (["--models", "a,b", "--batching", "arrival,length"], "--batching arrival,length: not read by a --models"),
        (["--memory-only", "--concurrency", "4", "--grpc-client", "h2"], "--grpc-client, --concurrency: not read"),
        (["--memory-only", "--workloads", "short,mixed"], "--workloads short,mixed: not read by a --memory-only"),
    ],
)
def test_an_option_the_run_does_not_read_is_refused(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--models measured nothing over --protocols nor from --grpc-client, and said nothing, while the report's
    command echoed them."""
    status = _bench("--repository", "/nonexistent/repo", "--output", str(tmp_path / "out"), *flags)
    err = capsys.readouterr().err
    assert status == 2 and message in err, err


def test_a_memory_run_of_no_requests_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--memory-only", "--rss-requests", "0"]
    status = _bench("--repository", "/nonexistent/repo", "--output", str(tmp_path / "out"), *flags)
    err = capsys.readouterr().err
    assert status == 2 and "--rss-requests 0: a --memory-only run would measure nothing" in err, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--graph", "int8"], "--graph int8: --quick's tiny model has the fp32, optimized, optimized-cpu graphs"),
        (["--graph", "fp16", "--memory-only"], "--graph fp16: --quick's tiny model has the fp32, optimized"),
        (["--graph", "optimized", "--models", "a,b"], "--graph optimized: --quick's tiny models have the fp32 graph"),
        # every graph --graphs names lacking (one of several is skipped with a note, as documented)
        (["--graphs", "int8,fp16", "--memory-only"], "--graphs int8,fp16: --quick's tiny model has the fp32, opt"),
    ],
)
def test_a_graph_quicks_model_lacks_is_refused_before_it_is_made(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--quick --graph int8` made the tiny model, which has no int8 graph, and failed 17 s later."""
    status = _bench("--quick", "--output", str(tmp_path / "out"), *flags)
    err = capsys.readouterr().err
    assert status == 2 and message in err, err


@pytest.mark.parametrize("run", [[], ["--memory-only"]])
def test_a_model_quicks_own_repository_lacks_is_refused(
    run: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--quick --model mine` benched the tiny bench-tiny model it made, and the report's command said mine."""
    from mhaserve.loadtest.bench import memory_only
    from mhaserve.loadtest.bench import run as sweep

    def measured(*_: object) -> None:  # where the refusal is missing, no bench runs inside the suite
        raise AssertionError("the run was not refused")

    monkeypatch.setattr(sweep, "run", measured)
    monkeypatch.setattr(memory_only, "run", measured)
    status = _bench("--quick", "--model", "mine", "--output", str(tmp_path / "out"), *run)
    err = capsys.readouterr().err
    message = (
        "--model mine: --quick without --repository benches a tiny random model of its own (bench-tiny): give "
        "--repository with that model, or leave --model out"
    )
    assert status == 2 and message in err, err


@pytest.mark.slow
def test_a_memory_run_that_measures_no_graph_fails(tiny_entry: Path, tmp_path: Path) -> None:
    """`--memory-only --graphs fp16` on an entry without it exited 0 with a report of no graph. (--quick's own
    tiny model is refused such --graphs before it is made: test_a_graph_quicks_model_lacks_is_refused_...)"""
    import shutil

    entry = tmp_path / "repo" / "tiny" / "1"  # the suite's tiny model without its fp16 and int8 graphs
    shutil.copytree(tiny_entry, entry)
    manifest = json.loads((entry / "manifest.json").read_text())
    for graph in ("fp16", "int8"):
        (entry / manifest["graphs"].pop(graph)["file"]).unlink()
    (entry / "manifest.json").write_text(json.dumps(manifest))
    cmd = [
        sys.executable, "-m", "mhaserve.cli", "bench", "--memory-only", "--output", str(tmp_path / "out"),
        "--repository", str(tmp_path / "repo"), "--model", "tiny", "--graphs", "fp16,int8", "--rss-requests", "200",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 1, run.stderr[-4000:]
    assert "mhaserve bench: error: no graph to measure: fp16: the entry has no fp16 graph" in run.stderr
    assert "int8: the entry has no int8 graph" in run.stderr and "Traceback" not in run.stderr


def test_paired_rounds_measure_the_http_variant_the_run_measures() -> None:
    """With --protocols grpc,http-base64 the paired rounds measured gRPC alone: they looked for `http` only."""
    from mhaserve.loadtest.bench import report, run

    assert run.paired_http(("grpc", "http-base64")) == "http-base64"
    assert run.paired_http(("grpc", "http", "http-base64")) == "http"  # the float one, as before
    assert run.paired_http(("grpc", "grpc-sync")) is None
    got = {
        "ceiling": {"seq_per_s": 100.0},
        "served": {"seq_per_s": 80.0, "clients": 32},
        "grpc": {"seq_per_s": 60.0},
        "http-base64": {"seq_per_s": 50.0},
    }
    ratios = run._paired_round(got, ["in process", "grpc", "http-base64"])["ratios"]
    assert ratios["http-base64/ceiling"] == 0.5 and ratios["http-base64/served"] == 50.0 / 80.0
    assert set(ratios) <= set(report._RATIO_NAMES)  # each worded in the report


def _mix(bulk: int, errors: dict[str, int], answered: int = 10, bulk_texts_per_s: float | None = 0.0) -> dict:
    return {
        "bulk_clients": bulk,
        "bulk_inputs": 64,
        "seconds": 1.0,
        "rate": 10.0,
        "queries": 10,
        "answered": answered,
        "latency_ms": {"p50": 5.0, "p95": 6.0, "p99": 7.0, "mean": 5.5, "n": answered},
        "bulk_texts_per_s": None if not bulk else bulk_texts_per_s,
        "errors": errors,
    }


def test_queries_beside_bulk_requests_that_all_failed_are_no_result(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With every bulk request refused (a server's --max-client-batch-size under 64), the summary quoted the
    queries' p50 "beside 1" as a result, and the run exited 0."""
    import io
    import types

    from mhaserve.loadtest.bench import beside, report, run
    from mhaserve.runtime.progress import Progress

    assert beside.failure(_mix(1, {"bulk: HTTP 413": 12})) == "every bulk request failed (bulk: HTTP 413 12)"
    assert beside.failure(_mix(1, {"bulk: HTTP 429": 2}, bulk_texts_per_s=640.0)) is None  # some got through
    assert beside.failure(_mix(0, {"query: timeout": 10}, answered=0)) == "no query was answered (query: timeout 10)"
    assert beside.failure(_mix(0, {})) is None

    async def measure(url: str, texts: object, bulk: int, *args: object) -> dict:
        return _mix(bulk, {"bulk: HTTP 413": 12} if bulk else {})

    monkeypatch.setattr(beside, "measure", measure)
    opt = {"beside_bulk": (1, 2), "paired": 1, "seed": 0, "duration": 1.0, "query_rate": 10.0}
    workload = types.SimpleNamespace(name="short", texts=["a"], to_dict=dict)
    server = types.SimpleNamespace(http_url="http://127.0.0.1:1", batching="length")
    mixed = run._beside_bulk(opt, {}, server, workload, Progress(1, io.StringIO()))  # type: ignore[arg-type]
    assert mixed["median"]["1"]["failed"] == "every bulk request failed (bulk: HTTP 413 12) in 1 of 1 round(s)"
    line = report._beside_bulk_line(mixed)
    assert "5.0 ms** beside 1" not in line and "FAILED beside 1: every bulk request failed" in line, line
    assert report.failures({"beside_bulk": mixed}) == [
        "queries beside 1 bulk clients: every bulk request failed (bulk: HTTP 413 12) in 1 of 1 round(s)",
        "queries beside 2 bulk clients: every bulk request failed (bulk: HTTP 413 12) in 1 of 1 round(s)",
    ]

    # The report is written, marked, and the run exits 1, as a failed check of the reliability run does.
    def run_writing(args: argparse.Namespace) -> Path:
        out = Path(args.output)
        (out / "report.md").write_text("# report\n")
        (out / "report.json").write_text('{"failed": ["queries beside 1 bulk clients: every bulk request failed"]}')
        return out

    monkeypatch.setattr(run, "run", run_writing)
    status = _bench("--repository", "/nonexistent/repo", "--output", str(tmp_path / "out"))
    captured = capsys.readouterr()
    assert status == 1 and "# report" in captured.out
    assert captured.err.endswith(
        "mhaserve bench: error: a measurement failed (the report marks it): queries beside 1 bulk clients: every "
        "bulk request failed\n"
    ), captured.err
