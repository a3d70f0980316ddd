"""The entry a bench measures in process is the one its server serves: the same graph for the same device."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from mhaserve.loadtest.bench import entries


@pytest.mark.parametrize(("device", "graph"), [("cpu", "optimized-cpu"), ("cuda", "optimized")])
def test_the_bench_picks_the_graph_its_server_serves_on_its_device(tiny_repo: Path, device: str, graph: str) -> None:
    """`--graph auto` serves another graph on the CPU than on CUDA: the in-process ceiling must run the same one
    (the bench refuses a server whose graph differs from what it ran in process)."""
    opt = {"repository": str(tiny_repo), "model": "tiny", "graph": "auto", "quick": False, "device": device}
    with contextlib.ExitStack() as stack:
        _, entry = entries.chosen_entry(opt, stack)
    assert entry.graph == graph and entry.graph_path.name == f"model.{graph}.onnx"


def test_the_bench_reads_the_repository_serve_reads(tiny_repo: Path, tmp_path: Path) -> None:
    """MHASERVE_REPOSITORY is the repository of `mhaserve bench` as of `mhaserve serve`: the bench measured
    ./models while a server under the same environment served another folder. --repository still wins, and
    --quick without one still makes its own tiny model."""
    import argparse

    from mhaserve.loadtest.bench import options

    p = argparse.ArgumentParser()
    options.add_arguments(p)
    env = {"MHASERVE_REPOSITORY": str(tiny_repo)}
    opt = options.resolve(p.parse_args(["--model", "tiny", "--device", "cpu"]), env)
    with contextlib.ExitStack() as stack:
        repository, entry = entries.chosen_entry(opt, stack)
    assert repository == tiny_repo and entry.name == "tiny"
    given = options.resolve(p.parse_args(["--repository", str(tmp_path)]), env)
    assert given["repository"] == str(tmp_path)
    assert options.resolve(p.parse_args(["--quick"]), env)["repository"] is None
    assert options.resolve(p.parse_args([]), {})["repository"] is None  # then models/
