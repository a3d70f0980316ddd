"""Does a tighter padding cap pay on a one-thread share? The batches the length policy forms for CLIENTS
closed-loop clients (loadtest/bench/inprocess.py's served_batches: one worker, nothing but the model taking
time) under each padding cap, timed on an ONNX Runtime session of THREADS threads, the caps taking turns for
ROUNDS rounds. Short texts unless WORKLOAD=mixed. Tokenisation is not counted (the same for every cap).
Run from the repository root:
  python docs/bench/2026-11-27-ninth/padding_cap.py ROUNDS THREADS CLIENTS CAP...
"""

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from mhaserve.loadtest.bench.inprocess import served_batches
from mhaserve.runtime.engine import _session_options
from mhaserve.runtime.repository import ModelRepository
from mhaserve.service.batching.padding import pad

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eighth"))
from trace_fixed import workload  # noqa: E402


def main(rounds: int, threads: int, clients: int, caps: list[float]) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    work = workload(os.environ.get("WORKLOAD", "short"))
    session = ort.InferenceSession(
        str(entry.graph_path), sess_options=_session_options(threads, 1), providers=["CPUExecutionProvider"]
    )
    feeds = {}
    for cap in caps:
        plan = served_batches(work, clients, max_padding=cap, budget=8192)
        batches = []
        real = padded = 0
        for rows in plan:
            seqs = [np.asarray(work.ids[i], np.int64) for i in rows]
            ids, mask = pad(seqs, 0)
            batches.append({"input_ids": ids, "attention_mask": mask})
            real += sum(map(len, seqs))
            padded += ids.size
        feeds[cap] = batches
        print(f"cap {cap}: {len(plan)} batches, mean rows {len(work.ids) / len(plan):.2f}, "
              f"padding {1 - real / padded:.3f}", flush=True)  # fmt: skip
    seq_per_s: dict[float, list[float]] = {cap: [] for cap in caps}
    for r in range(rounds):
        order = caps[r % len(caps) :] + caps[: r % len(caps)]
        for cap in order:
            t0 = time.perf_counter()
            for f in feeds[cap]:
                session.run(None, f)
            seq_per_s[cap].append(len(work.ids) / (time.perf_counter() - t0))
        print(f"round {r}: " + "  ".join(f"cap {c} {seq_per_s[c][-1]:6.1f}" for c in caps), flush=True)
    base = caps[0]
    for cap in caps:
        ratios = [a / b for a, b in zip(seq_per_s[cap], seq_per_s[base], strict=True)]
        print(f"cap {cap}: median {statistics.median(seq_per_s[cap]):6.1f} seq/s, against cap {base}: "
              f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), [float(c) for c in sys.argv[4:]])
