"""`mhaserve bench --models A,B`: the shares it reports from its points, and a quick run end to end against one
server serving two tiny random models. No throughput is asserted: it depends on the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mhaserve.loadtest.bench import models, options

ROOT = Path(__file__).resolve().parents[2]


def _point(seq_per_s: dict[str, float], errors: dict[str, int] | None = None) -> dict[str, Any]:
    per_model = {
        m: {"seq_per_s": v, "latency_ms": {"p50": 10.0, "p99": 20.0}, "errors": dict(errors or {})}
        for m, v in seq_per_s.items()
    }
    return {
        "models": per_model,
        "seq_per_s": sum(seq_per_s.values()),
        "server_cpu_cores": 1.9,
        "other_cpu_cores": 0.05,
        "disturbed": False,
    }


def test_shares_are_together_over_alone_and_add_up() -> None:
    row: dict[str, Any] = {
        "clients": 32,
        "alone": {"a": _point({"a": 100.0}), "b": _point({"b": 50.0}, {"UNAVAILABLE": 1})},
        "together": _point({"a": 60.0, "b": 15.0}, {"UNAVAILABLE": 2}),
    }
    summary = models.summarize({"points": {"short": [row]}})["short"][0]
    assert summary["clients"] == 32 and summary["together_seq_per_s"] == 75.0
    assert summary["models"]["a"]["share"] == pytest.approx(0.6)
    assert summary["models"]["b"]["share"] == pytest.approx(0.3)
    assert summary["sum_of_shares"] == pytest.approx(0.9)
    # each model's requests together priced at its CPU per request alone: a 60 x 1.9/100, b 15 x 1.9/50
    assert summary["cpu_per_request_ratio"] == pytest.approx(1.9 / (60 * 1.9 / 100 + 15 * 1.9 / 50))
    assert summary["models"]["a"]["errors"] == {"UNAVAILABLE": 2}  # alone's none and together's two
    assert summary["models"]["b"]["errors"] == {"UNAVAILABLE": 3}
    # a model that did nothing alone has no share, and then neither has the sum
    row["alone"]["b"] = _point({"b": 0.0})
    summary = models.summarize({"points": {"short": [row]}})["short"][0]
    assert summary["models"]["b"]["share"] is None and summary["sum_of_shares"] is None
    assert summary["cpu_per_request_ratio"] is None
    # the together point's other CPU is marked where other processes took more than the guard's cores, as each
    # model's is (it was never marked: a review's finding)
    assert summary["together_disturbed"] is False
    row["together"]["disturbed"] = True
    assert models.summarize({"points": {"short": [row]}})["short"][0]["together_disturbed"] is True


@pytest.mark.slow
def test_quick_two_models_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "models"
    cmd = [
        sys.executable, "-m", "mhaserve.cli", "bench", "--quick", "--models", "left,right",
        "--workloads", "short", "--output", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "models" and "--models left,right" in report["command"]
    # two models of different widths, one server
    assert list(report["models"]) == ["left", "right"]
    assert report["models"]["left"]["dimensions"] != report["models"]["right"]["dimensions"]

    rows = report["points"]["short"]
    assert [r["clients"] for r in rows] == list(options.QUICK["concurrency"])
    for row in rows:
        assert list(row["alone"]) == ["left", "right"]
        for name, alone in row["alone"].items():
            # alone: that model's clients only; the other model's batches are not counted in its figures
            assert list(alone["models"]) == [name]
            m = alone["models"][name]
            assert m["completed"] > 0 and m["errors"] == {} and m["batches"] >= 1
        together = row["together"]["models"]
        assert list(together) == ["left", "right"]
        for name, m in together.items():
            assert m["completed"] > 0 and m["errors"] == {} and m["warm_clients"] == row["clients"], name
            assert m["batches"] >= 1 and m["mean_batch_size"] >= 1
        assert row["together"]["seq_per_s"] == pytest.approx(sum(m["seq_per_s"] for m in together.values()))

    for s in report["summary"]["short"]:
        assert s["sum_of_shares"] == pytest.approx(sum(m["share"] for m in s["models"].values()))
        assert all(m["share"] > 0 for m in s["models"].values()) and s["cpu_per_request_ratio"] > 0
    md = (out / "report.md").read_text()
    assert "## Each model alone and together" in md and "| short | 4 | **together** |" in md
