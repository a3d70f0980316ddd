"""seq/s of ONNX Runtime on THREADS threads over 1,000 of the short texts sorted by length (every other one of
the 2,000), in batches of 1, 2, 4 and 8, for ROUNDS rounds: how much batching gains on a one-thread share
(what each of two inference workers has under load) against all cores. Tokenisation is not counted.
Run from the repository root:
  python docs/bench/2026-11-27-ninth/batch_sizes.py THREADS ROUNDS
"""

import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from mhaserve.loadtest.bench.workloads import build
from mhaserve.runtime.engine import _session_options
from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving


def main(threads: int, rounds: int) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    workload = build(["short"], tokenizer, max_seq_len=entry.manifest.max_seq_len, fixed_tokens=128,
                     fixed_pool=64, mixed_pool=256, short_pool=2000)["short"]  # fmt: skip
    seqs = sorted(workload.ids, key=len)[::2]
    session = ort.InferenceSession(
        str(entry.graph_path), sess_options=_session_options(threads, 1), providers=["CPUExecutionProvider"]
    )

    def run(batch: list[list[int]]) -> None:
        ids = np.zeros((len(batch), max(map(len, batch))), np.int64)
        mask = np.zeros_like(ids)
        for r, s in enumerate(batch):
            ids[r, : len(s)] = s
            mask[r, : len(s)] = 1
        session.run(None, {"input_ids": ids, "attention_mask": mask})

    for r in range(rounds):
        out = []
        for b in (1, 2, 4, 8):
            t0 = time.perf_counter()
            for i in range(0, len(seqs), b):
                run(seqs[i : i + b])
            out.append(f"b={b} {len(seqs) / (time.perf_counter() - t0):6.1f}")
        print(f"threads {threads} round {r}: " + "  ".join(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
