"""A lone 128-token input, in process: the engine as the one-at-a-time row builds it (one session) and as the
server's two workers build it (a second session, the arena shared), alternated in 5 rounds of 60 runs, each
run 1 ms after the last. The full run put the server's lone fixed input 3.16 ms above the first; is the
server's engine slower? From the repository root:
  python docs/bench/2026-11-29-twentysixth/lone_fixed.py
"""

import statistics
import time
from pathlib import Path

import numpy as np

from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.repository import ModelRepository

entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized-cpu", device="cpu")
ids = np.random.default_rng(0).integers(1000, 20000, size=(1, 128)).astype(np.int64)
mask = np.ones_like(ids)


def engine(threads: int | None) -> OnnxEngine:
    m = entry.manifest
    return OnnxEngine(
        entry.graph_path, max_seq_len=m.max_seq_len, vocab_size=m.vocab_size, device="cpu", overlap_threads=threads
    )


engines = {"one session": engine(None), "two sessions, shared arena": engine(1)}
medians: dict[str, list[float]] = {name: [] for name in engines}
for _ in range(5):
    for name, e in engines.items():
        for _ in range(5):
            e.run(ids, mask)
        times = []
        for _ in range(60):
            t0 = time.perf_counter()
            e.run(ids, mask)
            times.append(time.perf_counter() - t0)
            time.sleep(0.001)
        medians[name].append(statistics.median(times) * 1e3)
for name, values in medians.items():
    print(f"{name:28s} median {statistics.median(values):.2f} ms, rounds {', '.join(f'{v:.2f}' for v in values)}")
