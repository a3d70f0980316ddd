"""Pure compute, and sums over 16 MB and 96 MB arrays, back to back and each after 100 ms asleep; then 10
consecutive chunks of compute after each sleep. Run: python docs/bench/2026-11-29-twentythird/after_sleep.py
"""

import statistics
import time

import numpy as np


def compute(n=20000):
    x = 0
    for i in range(n):
        x += i * i
    return x


a = np.random.rand(2_000_000)  # 16 MB: streams from L3/DRAM
b = np.random.rand(12_000_000)  # 96 MB, like the weights


def mem_small():
    return a.sum()


def mem_big():
    return b.sum()


for name, f in [("compute 20k iters", compute), ("sum 16 MB", mem_small), ("sum 96 MB", mem_big)]:
    for _ in range(5):
        f()
    hot, cold = [], []
    for _ in range(40):
        t = time.perf_counter()
        f()
        hot.append(time.perf_counter() - t)
    for _ in range(40):
        time.sleep(0.1)
        t = time.perf_counter()
        f()
        cold.append(time.perf_counter() - t)
    print(
        f"{name:18s}: hot {1e3 * statistics.median(hot):.3f} ms, "
        f"after 100 ms asleep {1e3 * statistics.median(cold):.3f} ms"
    )
# within a cold run: split compute into 10 chunks and time each
chunks = [[] for _ in range(10)]
for _ in range(40):
    time.sleep(0.1)
    for k in range(10):
        t = time.perf_counter()
        compute(2000)
        chunks[k].append(time.perf_counter() - t)
print(
    "compute in 10 consecutive chunks after sleep (us):", " ".join(f"{1e6 * statistics.median(c):.0f}" for c in chunks)
)
