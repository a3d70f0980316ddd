"""ONNX Runtime in process, one intra-op thread (a worker's share of 2 cores), on the fused graph: texts a
second when batches are cut at a token budget (padding included), the workload's inputs sorted by length as
the length policy sorts them. Rounds alternate the budgets' order. Run from the repository root:
  python docs/bench/2026-11-28-twentieth/budget_in_process.py ROUNDS SECONDS BUDGET...
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from mhaserve.loadtest.bench.workloads import build
from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.service.batching.padding import pad


def batches(ids: list[list[int]], budget: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Consecutive inputs of the length-sorted list while rows x longest fits the budget (one at least)."""
    out, cur = [], []
    for s in sorted(ids, key=len):
        if cur and (len(cur) + 1) * len(s) > budget:
            out.append(cur)
            cur = []
        cur.append(s)
    out.append(cur)
    return [pad(b, 0) for b in out]


def rate(session: ort.InferenceSession, plan: list[tuple[np.ndarray, np.ndarray]], seconds: float) -> float:
    """Texts a second over whole passes of the plan's batches (a pass is every input once), at least `seconds`."""
    done, start = 0, time.perf_counter()
    while True:
        for x, m in plan:
            session.run(None, {"input_ids": x, "attention_mask": m})
            done += len(x)
        if time.perf_counter() - start >= seconds:
            return done / (time.perf_counter() - start)


def main(rounds: int, seconds: float, budgets: list[int]) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    loads = build(["short", "mixed", "fixed"], tokenizer, max_seq_len=entry.manifest.max_seq_len, fixed_tokens=128,
                  fixed_pool=64, mixed_pool=256, short_pool=500)  # fmt: skip
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(entry.graph_path), opts, providers=["CPUExecutionProvider"])
    plans = {(w, b): batches(loads[w].ids, b) for w in loads for b in budgets}
    for plan in plans.values():  # the arena sees every shape once
        rate(session, plan[:1] + plan[-1:], 0.0)
    got: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for b in budgets if r % 2 == 0 else list(reversed(budgets)):
            for w in loads:
                got.setdefault((w, b), []).append(rate(session, plans[(w, b)], seconds))
        print(f"round {r}: " + ", ".join(f"{w} {b} {v[-1]:.1f}" for (w, b), v in got.items()), flush=True)
    print(f"texts a second, one thread, medians of {rounds} rounds (rows a batch on average)")
    for w in loads:
        print(f"  {w:6s}" + "".join(f"  {b}: {statistics.median(got[(w, b)]):6.1f} "
                                     f"({len(loads[w].ids) / len(plans[(w, b)]):.1f})" for b in budgets))  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), [int(b) for b in sys.argv[3:]])
