"""The locustfile, headless against a real server over gRPC and over HTTP: successes recorded, and failures
by gRPC status or HTTP status."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mhaserve.loadtest.bench.client import Server
from mhaserve.testing.loopback import free_port

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"

pytestmark = pytest.mark.slow


def _locust(
    server: Server, out: Path, workload: str, *extra: str, protocol: str = "grpc"
) -> subprocess.CompletedProcess[str]:
    host = server.http_url if protocol == "http" else server.address
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--protocol", protocol,
        "-H", host, "-u", "4", "-r", "4", "-t", "2s", "--only-summary",
        "--workload", workload, "--csv", str(out / "stats"), "--json-file", str(out / "stats"),
        *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


def _entries(out: Path) -> dict[str, dict[str, Any]]:
    """The run's final figures by task name, from stats.json, which Locust writes at exit. Not from the
    CSV: Locust rewrites it once a second and not at exit, so after a 2 s run on a busy machine it may
    hold none of the requests."""
    return {e["name"]: e for e in json.loads((out / "stats.json").read_text())}


@pytest.mark.parametrize(
    ("protocol", "method", "failure"),
    [
        ("grpc", "Encode", "Encode bad: INVALID_ARGUMENT: "),
        ("http", "POST", "POST bad: HTTP 400: input 1 is an empty string"),
    ],
)
def test_successes_and_failures_named_by_their_status(
    tiny_server: Server, tmp_path: Path, protocol: str, method: str, failure: str
) -> None:
    run = _locust(tiny_server, tmp_path, "short,bad", "--max-fail-ratio", "0.9", protocol=protocol)
    assert run.returncode == 0, run.stderr[-3000:]

    entries = _entries(tmp_path)
    short, bad = entries["short"], entries["bad"]
    assert short["method"] == method and short["num_requests"] > 0 and short["num_failures"] == 0
    assert bad["num_failures"] == bad["num_requests"] > 0

    # The error report printed at exit names every failure by its gRPC status (HTTP status and message).
    errors = [m.group(1) for m in re.finditer(r"^\s*\d+\s+(\w+ \w+: .+)$", run.stderr, re.M)]
    assert errors and all(e.startswith(failure) for e in errors), errors
    for csv_file in ("stats_stats.csv", "stats_failures.csv"):  # written too, for `make loadtest`'s reports
        assert (tmp_path / csv_file).stat().st_size > 0


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_ids_workload_records_an_unknown_model_as_failures(
    tiny_server: Server, tmp_path: Path, protocol: str
) -> None:
    """Its users ask for the model's shape first: that call failing once killed each user at its start, and
    the run idled to its end with no request recorded."""
    run = _locust(tiny_server, tmp_path, "ids", "--model", "nope", protocol=protocol)
    assert run.returncode == 1, run.stderr[-3000:]
    info = _entries(tmp_path)["model info"]
    assert info["num_failures"] == info["num_requests"] > 0
    assert ("NOT_FOUND" if protocol == "grpc" else "HTTP 404") in run.stderr
    assert "Traceback" not in run.stderr


def test_an_http_call_past_the_rpc_timeout_is_named_a_timeout(tmp_path: Path) -> None:
    """Once named CONNECTION, as a refused connection is, and backed off from."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections (the backlog) and never answers
        host = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cmd = [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--protocol", "http", "-H", host,
            "-u", "2", "-r", "2", "-t", "2s", "--only-summary", "--workload", "short", "--rpc-timeout", "0.3",
            "--json-file", str(tmp_path / "stats"),
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 1
    errors = [m.group(1) for m in re.finditer(r"^\s*\d+\s+(\w+ \w+: .+)$", run.stderr, re.M)]
    assert errors and all(e.startswith("POST short: TIMEOUT: no answer within --rpc-timeout 0.3 s") for e in errors), (
        errors
    )


def test_exit_status_follows_the_failure_threshold(tiny_server: Server, tmp_path: Path) -> None:
    run = _locust(tiny_server, tmp_path, "short,bad", "--max-fail-ratio", "0.05")
    assert run.returncode == 1
    assert "more than the allowed 5.00%" in run.stderr


def test_every_other_task_set_succeeds(tiny_server: Server, tmp_path: Path) -> None:
    run = _locust(
        tiny_server, tmp_path, "query,long,mixed,batch,ids,stream", "--batch-size", "3", "--max-fail-ratio", "0"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    entries = _entries(tmp_path)
    for name in ("query", "long", "mixed", "batch3", "ids", "stream"):
        assert entries[name]["num_requests"] > 0, name
        assert entries[name]["num_failures"] == 0, name
    assert entries["stream"]["method"] == "EncodeStream"


# ---- over HTTP: OpenAI POST /v1/embeddings -------------------------------------------------------------


def test_http_every_task_set_but_stream_succeeds_with_base64_vectors(tiny_server: Server, tmp_path: Path) -> None:
    run = _locust(
        tiny_server, tmp_path, "query,long,mixed,batch,ids", "--batch-size", "3", "--encoding-format", "base64",
        "--max-fail-ratio", "0", protocol="http",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    entries = _entries(tmp_path)
    for name in ("query", "long", "mixed", "batch3", "ids"):
        assert entries[name]["num_requests"] > 0, name
        assert entries[name]["num_failures"] == 0, name
        assert entries[name]["method"] == "POST"


def test_http_refuses_the_grpc_only_stream(tiny_server: Server, tmp_path: Path) -> None:
    run = _locust(tiny_server, tmp_path, "stream", protocol="http")
    assert run.returncode == 2
    assert "--workload stream is gRPC only" in run.stderr


def test_an_unknown_workload_is_refused_before_the_run(tiny_server: Server, tmp_path: Path) -> None:
    # Refused at start-up (exit 2, as argparse does), not in each user after which the run idled; no
    # request is made, and nothing is written as if a run had happened.
    run = _locust(tiny_server, tmp_path, "shrot", "-t", "30s")
    assert run.returncode == 2
    assert "--workload 'shrot': unknown ['shrot']; choose from" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "stats.json").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--batch-size", "0"), "--batch-size must be >= 1, got 0"),
        (("--stream-requests", "0"), "--stream-requests must be >= 1, got 0"),
        (("--max-fail-ratio", "-1"), "--max-fail-ratio must be a fraction in [0, 1], got -1.0"),
        (("--corpus", "/nonexistent/corpus.txt"), "--corpus /nonexistent/corpus.txt: no such file"),
        (("--tokenizer", "/nonexistent/tokenizer.json"), "--tokenizer /nonexistent/tokenizer.json: no such file"),
    ],
)
def test_bad_options_are_refused_before_the_run(
    tiny_server: Server, tmp_path: Path, options: tuple[str, ...], message: str
) -> None:
    """Each of these failed in every user's start (or ran requests the server had to refuse, or reported
    'no requests were made: is the server up?'), and the run idled for its whole --run-time."""
    run = _locust(tiny_server, tmp_path, "mixed", *options, "-t", "30s")
    assert run.returncode == 2, run.stderr[-2000:]
    assert message in run.stderr and "Traceback" not in run.stderr


def test_a_worker_reads_the_corpus_beside_its_own_locustfile(tiny_server: Server, tmp_path: Path) -> None:
    """Distributed: the master sends its options to the workers. A default corpus path of the master's own
    checkout (here a copy of the locustfile with no corpus beside it) named nothing on the worker."""
    master_dir = tmp_path / "master"
    master_dir.mkdir()
    (master_dir / "locustfile.py").write_text(LOCUSTFILE.read_text())
    port = str(free_port())
    master = subprocess.Popen(
        [
            sys.executable, "-m", "locust", "-f", str(master_dir / "locustfile.py"), "--master", "--headless",
            "--master-bind-host", "127.0.0.1", "--master-bind-port", port, "--expect-workers", "1",
            "-H", tiny_server.address, "-u", "2", "-r", "2", "-t", "3s", "--workload", "mixed,short",
            "--json-file", str(tmp_path / "stats"), "--max-fail-ratio", "0",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=master_dir,
    )  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", "127.0.0.1",
         "--master-port", port],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        out, _ = master.communicate(timeout=60)
    finally:
        worker.kill()
        worker.wait()
    assert master.returncode == 0, out[-3000:]
    assert sum(e["num_requests"] for e in _entries(tmp_path).values()) > 0
