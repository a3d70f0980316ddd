"""In-process speed of an entry's graphs against one another, measured so that a shared machine cannot skew it.

Every batch is run by every graph in turn, in an order that rotates from batch to batch and round to round,
so that a burst of load from elsewhere falls on all graphs alike. A graph's figure is the median over rounds
of (time of the first graph / time of this graph), with the range of the rounds.

The export records a small run of it in the manifest (`speed_at_export`): one intra-op thread and that
thread's CPU time, which other processes barely disturb (they take turns on the core, not the work), over the
int8 gate's texts. `testing/graph_speed.py` runs the same measurement over the bench's corpora for the
tables of docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from mhaserve.runtime.engine import Engine

Ids = npt.NDArray[np.int64]
Batch = tuple[Ids, Ids]
SHORT_TOKENS = 32  # "short": queries and sentences, what most search traffic sends


def batches(rows: Sequence[Sequence[int]], size: int, pad_id: int) -> list[Batch]:
    """The rows sorted by length and cut into padded batches of `size`: the least padding a batcher reaches."""
    ordered = sorted(rows, key=len)
    out = []
    for k in range(0, len(ordered), size):
        chunk = ordered[k : k + size]
        width = max(len(r) for r in chunk)
        ids = np.full((len(chunk), width), pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        out.append((ids, mask))
    return out


def interleaved(
    engines: dict[str, Engine], work: list[Batch], *, rounds: int, cpu_clock: bool
) -> dict[str, dict[str, float]]:
    """Sequences per second of each engine, and its speed relative to the first, measured interleaved."""
    runs = list(engines.values())
    for engine in runs:  # warm-up: ONNX Runtime plans its memory per shape on first sight
        for ids, mask in work:
            engine.run(ids, mask)
    clock = time.thread_time if cpu_clock else time.perf_counter
    n = len(runs)
    seconds = [[0.0] * rounds for _ in runs]
    for r in range(rounds):
        for b, (ids, mask) in enumerate(work):
            for j in range(n):
                g = (b + r + j) % n
                t0 = clock()
                runs[g].run(ids, mask)
                seconds[g][r] += clock() - t0
    rows = sum(len(ids) for ids, _ in work)
    out = {}
    for g, name in enumerate(engines):
        ratios = [first / mine for first, mine in zip(seconds[0], seconds[g], strict=True)]
        out[name] = {
            "seq_per_s": rows / statistics.median(seconds[g]),
            "speed": statistics.median(ratios),
            "speed_min": min(ratios),
            "speed_max": max(ratios),
        }
    return out


def at_export(
    engines: dict[str, Engine], tokenizer: Tokenizer, texts: list[str], *, pad_id: int, rounds: int = 3
) -> dict[str, dict[str, Any]]:
    """The manifest's figures: each graph's speed relative to the first (the unfused fp32 graph), per graph.

    short: the texts of at most 32 tokens, one per run (a search query); mixed: every text, in batches of
    16 sorted by length. Engines should run one intra-op thread: the figure is CPU time on the calling thread.
    """
    rows = [e.ids for e in tokenizer.encode_batch(texts)]
    loads = {
        "short": batches([r for r in rows if len(r) <= SHORT_TOKENS], 1, pad_id),
        "mixed": batches(rows, 16, pad_id),
    }
    measured = {name: interleaved(engines, work, rounds=rounds, cpu_clock=True) for name, work in loads.items()}
    first = next(iter(engines))
    return {
        graph: {
            "relative_to": first,
            "clock": "cpu time, 1 intra-op thread",
            **{
                name: {
                    "speed": round(m[graph]["speed"], 3),
                    "seq_per_s": round(m[graph]["seq_per_s"], 1),
                    "inputs": sum(len(ids) for ids, _ in loads[name]),
                }
                for name, m in measured.items()
            },
        }
        for graph in engines
    }
