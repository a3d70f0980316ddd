"""The locustfile, headless against a real server: successes recorded, and failures by gRPC status."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mhaserve.loadtest.bench.client import Server

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"

pytestmark = pytest.mark.slow


def _locust(server: Server, out: Path, workload: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-H", server.address, "-u", "4", "-r", "4", "-t", "2s", "--only-summary",
        "--workload", workload, "--csv", str(out / "stats"), "--json-file", str(out / "stats"),
        *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


def _rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def test_successes_and_failures_with_the_status_name(tiny_server: Server, tmp_path: Path) -> None:
    run = _locust(tiny_server, tmp_path, "short,bad", "--max-fail-ratio", "0.9")
    assert run.returncode == 0, run.stderr[-3000:]

    stats = _rows(tmp_path / "stats_stats.csv")
    assert int(stats["short"]["Request Count"]) > 0
    assert int(stats["short"]["Failure Count"]) == 0
    assert int(stats["bad"]["Request Count"]) > 0
    assert stats["bad"]["Failure Count"] == stats["bad"]["Request Count"]
    assert stats["short"]["Type"] == "Encode"

    failures = list(csv.DictReader((tmp_path / "stats_failures.csv").open()))
    assert [f["Name"] for f in failures] == ["bad"]
    assert failures[0]["Error"].startswith("INVALID_ARGUMENT: ")

    entries = {e["name"]: e for e in json.loads((tmp_path / "stats.json").read_text())}
    assert entries["short"]["num_requests"] > 0 and entries["short"]["num_failures"] == 0
    assert entries["bad"]["num_failures"] == entries["bad"]["num_requests"] > 0


def test_exit_status_follows_the_failure_threshold(tiny_server: Server, tmp_path: Path) -> None:
    run = _locust(tiny_server, tmp_path, "short,bad", "--max-fail-ratio", "0.05")
    assert run.returncode == 1
    assert "more than the allowed 5.00%" in run.stderr


def test_every_other_task_set_succeeds(tiny_server: Server, tmp_path: Path) -> None:
    run = _locust(tiny_server, tmp_path, "long,mixed,batch,ids,stream", "--batch-size", "3", "--max-fail-ratio", "0")
    assert run.returncode == 0, run.stderr[-3000:]
    stats = _rows(tmp_path / "stats_stats.csv")
    for name in ("long", "mixed", "batch3", "ids", "stream"):
        assert int(stats[name]["Request Count"]) > 0, name
        assert int(stats[name]["Failure Count"]) == 0, name
    assert stats["stream"]["Type"] == "EncodeStream"
