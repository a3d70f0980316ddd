"""Run one graph of the served entry on one intra-op thread, batches of 4 texts of 32 tokens, for `perf record`
(the twenty-fourth session's measurement of the fused graph, repeated on optimized-cpu). Run from the
repository root:
  perf record -F 2000 -o /tmp/perf.data python docs/bench/2026-11-29-twentyfifth/one_thread_loop.py optimized-cpu 8
  perf report -i /tmp/perf.data --no-children --sort dso,symbol
"""

import sys
import time
from pathlib import Path

import numpy as np

from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.repository import ModelRepository


def main(graph: str, seconds: float) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph=graph)  # type: ignore[arg-type]
    m = entry.manifest
    engine = OnnxEngine(entry.graph_path, max_seq_len=m.max_seq_len, vocab_size=m.vocab_size, device="cpu",
                        intra_op_threads=1)  # fmt: skip
    ids = np.random.default_rng(0).integers(1000, 20000, size=(4, 32), dtype=np.int64)
    mask = np.ones_like(ids)
    runs, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        engine.run(ids, mask)
        runs += 1
    print(f"{entry.graph}: {runs} runs in {seconds} s")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
