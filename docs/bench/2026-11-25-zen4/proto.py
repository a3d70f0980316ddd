"""Prototype: the length policy's batches (cap 0.1) vs a cost-model DP policy, replayed for 32 clients,
estimated by the fitted cost and timed in process (interleaved rounds) against the ceiling."""

import bisect
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from mhaserve.loadtest.bench import inprocess as IP
from mhaserve.loadtest.bench import workloads as W
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.service.batching import policies as P
from mhaserve.service.batching.padding import pad

A, Bc, C, D = [float(x) for x in sys.argv[2].split(",")]


def cost(rows, width):
    return A + Bc * rows + C * rows * width + D * rows * width * width


class CostDP(P.LengthAware):
    window = 64

    def take(self, budget, live, max_rows=None):
        anchor = self.oldest(live)
        if anchor is None:
            self._sorted.clear()
            return []
        self._arrivals.popleft()
        srt = self._sorted
        i = bisect.bisect_left(srt, anchor.key, key=P._key)
        # live neighbours, up to `window` on each side
        left, right = [], []
        j = i - 1
        while j >= 0 and len(left) < self.window:
            if live(srt[j]):
                left.append(j)
            j -= 1
        j = i + 1
        while j < len(srt) and len(right) < self.window:
            if live(srt[j]):
                right.append(j)
            j += 1
        idx = left[::-1] + [i] + right
        L = [srt[k].length for k in idx]
        n = len(L)
        a = len(left)
        maxr = max_rows or n
        # f[j]: least cost of batching L[:j] in contiguous groups
        f = [0.0] + [float("inf")] * n
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            w = L[j - 1]
            for s in range(max(0, j - maxr), j):
                rows = j - s
                if rows * w > budget and rows > 1:
                    continue
                v = f[s] + cost(rows, w)
                if v < f[j]:
                    f[j] = v
                    cut[j] = s
        # the group holding the anchor
        j = n
        while True:
            s = cut[j]
            if s <= a < j:
                break
            j = s
        batch = [srt[idx[k]] for k in range(s, j)]
        for x in batch:
            x.taken = True
        taken = set(idx[k] for k in range(s, j))
        self._sorted = [x for k, x in enumerate(srt) if k not in taken]
        return batch


def replay(workload, clients, policy, budget=8192, seed=0):
    orig = P.LengthAware
    IP_LA = policy
    import mhaserve.service.batching.policies as pol

    pol.LengthAware = lambda mp: IP_LA
    try:
        return IP.served_batches(workload, clients, max_padding=0.1, budget=budget, seed=seed)
    finally:
        pol.LengthAware = orig


tok = Tokenizer.from_file("models/all-minilm-l6-v2/1/tokenizer.json")
texts = [t for t in Path("loadtest/texts/short.txt").read_text().splitlines() if t.strip()]
wl = W.short(tok, texts, pool=2000) if sys.argv[3] == "short" else W.mixed(tok, W.load_corpus(), pool=2000)
plans = {
    "ceiling8": IP.batches(wl, 8),
    "ceiling16": IP.batches(wl, 16),
    "ceiling4": IP.batches(wl, 4),
    "cap0.1": replay(wl, 32, P.LengthAware(0.1)),
    "costdp": replay(wl, 32, CostDP(1.0)),
}


def est(plan):
    return sum(cost(len(b), max(len(wl.ids[i]) for i in b)) for b in plan)


for k, p in plans.items():
    tot = sum(len(b) for b in p)
    toks = sum(len(b) * max(len(wl.ids[i]) for i in b) for b in p)
    real = sum(len(wl.ids[i]) for b in p for i in b)
    print(
        f"{k:10s} batches {len(p):4d} mean {tot / len(p):5.2f} padding {1 - real / toks:.3f} est {est(p) / 1000:.2f} s"
    )
e = OnnxEngine(Path(sys.argv[1]), max_seq_len=256, vocab_size=30522, device="cpu")


def run(plan):
    t0 = time.perf_counter()
    for b in plan:
        e.run(*pad([np.asarray(wl.ids[i], dtype=np.int64) for i in b], 0))  # the batcher's own padding
    return time.perf_counter() - t0


run(plans["cap0.1"][:50])
res = {k: [] for k in plans}
names = list(plans)
for r in range(int(sys.argv[4])):
    order = names[r % len(names) :] + names[: r % len(names)]
    for k in order:
        res[k].append(len(wl.ids) / run(plans[k]))
for k in names:
    print(f"{k:10s} seq/s median {statistics.median(res[k]):6.1f} all {[round(x, 1) for x in res[k]]}")
