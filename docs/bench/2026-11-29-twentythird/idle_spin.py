"""ONNX Runtime in process (the fused graph, one short text a run, the engine the server opens), 100 ms before
each run spent asleep, spinning, or asleep then summing 200 MB; alternated. Run from the repository root:
  python docs/bench/2026-11-29-twentythird/idle_spin.py
"""

import statistics
import sys
import time

sys.path.insert(0, "docs/bench")
from pathlib import Path

import numpy as np
import one_client as oc
from tokenizers import Tokenizer

from mhaserve.runtime.repository import ModelRepository, onnx_engine

texts = oc.SHORT_TEXTS[:80]
entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
engine = onnx_engine("cpu")(entry)
tok = Tokenizer.from_file(str(entry.tokenizer_path))
tok.no_padding()
tok.enable_truncation(256)
buf = np.zeros(200 * 2**20 // 8)


def run(t):
    ids = np.asarray([tok.encode(t).ids], dtype=np.int64)
    engine.run(ids, np.ones_like(ids))


def spin(p):
    end = time.perf_counter() + p
    while time.perf_counter() < end:
        pass


def sleep_then_touch(p):
    time.sleep(p)
    buf.sum()


for t in texts[:30]:
    run(t)
for name, pause in [
    ("sleep", time.sleep),
    ("spin", spin),
    ("sleep+stream 200MB", sleep_then_touch),
    ("sleep", time.sleep),
    ("spin", spin),
]:
    lat = []
    for t in texts:
        pause(0.1)
        t0 = time.perf_counter()
        run(t)
        lat.append(time.perf_counter() - t0)
    print(f"{name:20s} 100 ms: p50 {1e3 * statistics.median(lat):.2f} ms", flush=True)
