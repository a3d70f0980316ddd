"""time(B, T) of the served graph in process, two threads, wall clock: median of runs."""

import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from mhaserve.runtime.engine import OnnxEngine

graph = Path(sys.argv[1])
threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
e = OnnxEngine(graph, max_seq_len=256, vocab_size=30522, device="cpu", intra_op_threads=threads)
rng = np.random.default_rng(0)
Bs = [1, 2, 3, 4, 6, 8, 12, 16]
Ts = [8, 12, 16, 24, 32, 48, 64]
for B, T in itertools.product(Bs, Ts):
    ids = rng.integers(1000, 20000, (B, T)).astype(np.int64)
    m = np.ones((B, T), np.int64)
    for _ in range(3):
        e.run(ids, m)
res = {}
for _round in range(5):
    for B, T in itertools.product(Bs, Ts):
        ids = rng.integers(1000, 20000, (B, T)).astype(np.int64)
        m = np.ones((B, T), np.int64)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            e.run(ids, m)
            ts.append(time.perf_counter() - t0)
        res.setdefault((B, T), []).append(min(ts))
print("B T ms ms/row")
X, y = [], []
for (B, T), v in sorted(res.items()):
    ms = statistics.median(v) * 1000
    print(B, T, f"{ms:.3f}", f"{ms / B:.3f}")
    X.append([1, B, B * T, B * T * T])
    y.append(ms)
coef, *_ = np.linalg.lstsq(np.array(X, float), np.array(y), rcond=None)
print("fit ms = a + b*B + c*B*T + d*B*T^2:", [f"{c:.5f}" for c in coef])
pred = np.array(X, float) @ coef
print("max rel err", float(np.max(np.abs(pred - y) / y)))
