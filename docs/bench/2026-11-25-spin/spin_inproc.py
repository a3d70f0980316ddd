"""In process: ORT spinning off (served default) vs on during runs only (force_spinning_stop) vs ORT's default.
Short corpus, tokenizer counted; one text at a time (p50 ms) and sorted batches of 16 (seq/s). Alternating rounds."""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

d = Path("models/all-minilm-l6-v2/1")
tok = Tokenizer.from_file(str(d / "tokenizer.json"))
tok.no_padding()
tok.enable_truncation(256)
texts = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()][:400]


def sess(mode):
    o = ort.SessionOptions()
    o.intra_op_num_threads = 2
    o.inter_op_num_threads = 1
    o.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if mode == "off":
        o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if mode == "run-only":
        o.add_session_config_entry("session.intra_op.allow_spinning", "1")
        o.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(str(d / "model.optimized.onnx"), o, providers=["CPUExecutionProvider"])


def run(s, batch):
    enc = tok.encode_batch(batch)
    T = max(len(e.ids) for e in enc)
    ids = np.zeros((len(batch), T), np.int64)
    m = np.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, : len(e.ids)] = e.ids
        m[i, : len(e.ids)] = 1
    return s.run(None, {"input_ids": ids, "attention_mask": m})


modes = sys.argv[1:] or ["off", "run-only", "default"]
S = {m: sess(m) for m in modes}
for s in S.values():
    run(s, texts[:16])
one = {m: [] for m in modes}
b16 = {m: [] for m in modes}
srt = sorted(texts, key=lambda t: len(tok.encode(t).ids))
for r in range(4):
    order = modes[r % len(modes) :] + modes[: r % len(modes)]
    for m in order:
        lat = []
        for t in texts[:150]:
            t0 = time.perf_counter()
            run(S[m], [t])
            lat.append(time.perf_counter() - t0)
            time.sleep(0.002)
        one[m].append(1000 * statistics.median(lat))
        t0 = time.perf_counter()
        for i in range(0, len(srt), 16):
            run(S[m], srt[i : i + 16])
        b16[m].append(len(srt) / (time.perf_counter() - t0))
        print(f"round {r} {m:9s} one p50 {one[m][-1]:.2f} ms  batch16 {b16[m][-1]:.1f} seq/s", flush=True)
for m in modes:
    print(
        f"{m:9s} one p50 median {statistics.median(one[m]):.2f} ms, "
        f"batch16 median {statistics.median(b16[m]):.1f} seq/s"
    )
