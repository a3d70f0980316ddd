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

from mhaserve.runtime.engine import _session_options
from mhaserve.runtime.repository import ModelRepository
from mhaserve.service.batching.padding import pad

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eighth"))
from trace_fixed import workload  # noqa: E402


def main(threads: int, rounds: int) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    work = workload("short")
    seqs = [np.asarray(s, np.int64) for s in sorted(work.ids, key=len)[::2]]
    session = ort.InferenceSession(
        str(entry.graph_path), sess_options=_session_options(threads, 1), providers=["CPUExecutionProvider"]
    )

    def run(batch: list[np.ndarray]) -> None:
        ids, mask = pad(batch, 0)
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
