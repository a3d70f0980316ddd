"""ONNX Runtime in process, one short text a run, with 1 intra-op thread, 2 spinning during runs only (the
server's), 2 never spinning, and 2 with ORT's default spinning: back to back and 100 ms asleep before each run,
then four runs back to back after each 100 ms asleep. Run from the repository root:
  python docs/bench/2026-11-29-twentythird/idle_threads.py [GRAPH]
"""

import statistics
import sys
import time

sys.path.insert(0, "docs/bench")
from pathlib import Path

import numpy as np
import one_client as oc
import onnxruntime as ort
from tokenizers import Tokenizer

from mhaserve.runtime.repository import ModelRepository

texts = oc.SHORT_TEXTS[:60]
entry = ModelRepository(Path("models")).entry(
    "all-minilm-l6-v2", graph=sys.argv[1] if len(sys.argv) > 1 else "optimized"
)
tok = Tokenizer.from_file(str(entry.tokenizer_path))
tok.no_padding()
tok.enable_truncation(256)


def sess(threads, spin, stop):
    o = ort.SessionOptions()
    o.intra_op_num_threads = threads
    o.inter_op_num_threads = 1
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    o.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if stop:
        o.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(
        str(entry.graph_path if hasattr(entry, "graph_path") else entry.graph), o, providers=["CPUExecutionProvider"]
    )


cfgs = {
    "1 thread": sess(1, True, True),
    "2 spin-run (ours)": sess(2, True, True),
    "2 no spin": sess(2, False, False),
    "2 ORT default spin": sess(2, True, False),
}
names = [i.name for i in next(iter(cfgs.values())).get_inputs()]


def run(s, t):
    ids = np.asarray([tok.encode(t).ids], dtype=np.int64)
    feed = {n: (ids if "input_ids" in n else (np.ones_like(ids) if "mask" in n else np.zeros_like(ids))) for n in names}
    s.run(None, feed)


for s in cfgs.values():
    for t in texts[:20]:
        run(s, t)
res = {k: {"hot": [], "idle": []} for k in cfgs}
for _round in range(2):
    for k, s in cfgs.items():
        for mode, p in (("hot", 0), ("idle", 0.1)):
            lat = []
            for t in texts:
                if p:
                    time.sleep(p)
                t0 = time.perf_counter()
                run(s, t)
                lat.append(time.perf_counter() - t0)
            res[k][mode].append(1e3 * statistics.median(lat))
for k in res:
    print(
        f"{k:20s} hot "
        + " ".join(f"{x:.2f}" for x in res[k]["hot"])
        + " | after 100 ms asleep "
        + " ".join(f"{x:.2f}" for x in res[k]["idle"])
    )
print("three runs back to back after 100 ms asleep (ms, medians):")
for k, s in cfgs.items():
    seq = [[], [], [], []]
    for t in texts[:40]:
        time.sleep(0.1)
        for i in range(4):
            t0 = time.perf_counter()
            run(s, t)
            seq[i].append(time.perf_counter() - t0)
    print(f"{k:20s} " + " ".join(f"{1e3 * statistics.median(x):.2f}" for x in seq))
