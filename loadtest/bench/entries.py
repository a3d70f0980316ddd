"""What a run measures: the models (tiny random ones made for --quick) and, for each, its workloads."""

from __future__ import annotations

import contextlib
import io
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mhaserve.loadtest.bench.workloads import Workload, build
from mhaserve.model.config import TINY
from mhaserve.runtime import manifest as mf
from mhaserve.runtime.devices import Device
from mhaserve.runtime.repository import GraphChoice, ModelEntry, ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving

QUICK_MODEL = "bench-tiny"  # the tiny model --quick without --repository makes and benches (not --models')


def quick_graphs(*, optimize: bool) -> tuple[str, ...]:
    """The graphs quick_repository's models have: fp32, and the fused ones where `optimize`; neither fp16 (a
    GPU graph) nor int8 (its quantisation and gate would add to every --quick run)."""
    return ("fp32", "optimized", mf.CPU_GRAPH) if optimize else ("fp32",)


def quick_repository(tmp: Path, names: Sequence[str], *, optimize: bool = True) -> Path:
    """Tiny random models exported (with the parity gate, and a fused graph where `optimize`) into a scratch
    repository: the first of TINY's width, each next one that much wider, so that two differ as real ones do."""
    from mhaserve.export.publish import ExportOptions, export_entry

    for k, name in enumerate(names):
        width = TINY["d_model"] * (k + 1)
        config: dict[str, object] = dict(TINY, d_model=width, d_ff=2 * width)
        export_entry(
            ExportOptions(source="random", repository=tmp, name=name, random_config=config, seed=k, optimize=optimize),
            out=io.StringIO(),
        )
    return tmp


def workloads(opt: dict[str, Any], entry: ModelEntry) -> dict[str, Workload]:
    """The workloads the options name, made with the entry's tokenizer and for its maximum length."""
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    sizes = {k: opt[k] for k in ("fixed_tokens", "fixed_pool", "mixed_pool", "short_pool", "seed")}
    return build(opt["workloads"], tokenizer, max_seq_len=entry.manifest.max_seq_len, **sizes)


def chosen_entry(opt: dict[str, Any], stack: contextlib.ExitStack) -> tuple[Path, ModelEntry]:
    """(repository, entry) a run benches: --model of --repository (models/), or with --quick and no
    repository a tiny random model in a scratch repository that `stack` removes afterwards."""
    repository, name = Path(opt["repository"] or "models"), opt["model"]
    if opt["quick"] and not opt["repository"]:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mhaserve-bench-")))
        repository, name = quick_repository(tmp, [QUICK_MODEL]), QUICK_MODEL
    return repository, entry(repository, name, opt["graph"], opt["device"])


def entry(repository: Path, name: str | None, graph: GraphChoice, device: Device) -> ModelEntry:
    """A model's latest version in the repository, verified, with the graph `graph` picks for `device` (the
    server's `--device`: `auto` serves another graph on the CPU than on CUDA)."""
    return ModelRepository(repository).entry(name, graph=graph, device=device)
