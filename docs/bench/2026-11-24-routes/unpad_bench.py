"""The fused graph against its unpadded rewrite (unpad.py), in process, 2 threads, on the short corpus.

usage: unpad_bench.py FUSED.onnx UNPADDED.onnx   (from the repository root, the default model exported)

First the largest difference of their embeddings over 30 random padded batches; then seq/s over whole
passes of batches made four ways: sorted by length in eights (the ceiling's batches), random groups of 32
cut where padding would pass 10 %, 30 % or 100 % of a batch's tokens, and one text at a time. Best of 3.
"""

import random
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

Batch = list[list[int]]


def padded(rows: Batch) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


def session(path: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def capped(texts: Batch, cap: float) -> list[Batch]:
    """Groups of 32 in arrival order, each sorted by length and cut where padding would pass `cap`."""
    out: list[Batch] = []
    for k in range(0, len(texts), 32):
        current: Batch = []
        for r in sorted(texts[k : k + 32], key=len):
            grown = [*current, r]
            padded_tokens = len(grown) * len(r)
            if current and padded_tokens - sum(map(len, grown)) > cap * padded_tokens:
                out.append(current)
                current = [r]
            else:
                current = grown
        out.append(current)
    return out


def main() -> None:
    tok = Tokenizer.from_file("models/all-minilm-l6-v2/2/tokenizer.json")
    tok.no_padding()
    tok.enable_truncation(256)
    texts = Path("loadtest/texts/short.txt").read_text().splitlines()[:2000]
    ids = [e.ids for e in tok.encode_batch(texts)]
    fused, unpadded = session(sys.argv[1]), session(sys.argv[2])

    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(30):
        ids_, mask = padded([ids[i] for i in rng.choice(len(ids), rng.integers(1, 17))])
        a = fused.run(None, {"input_ids": ids_, "attention_mask": mask})[0]
        b = unpadded.run(None, {"input_ids": ids_, "attention_mask": mask})[0]
        worst = max(worst, float(np.abs(a - b).max()))
    print("max abs diff", worst)

    arrival = list(ids)
    random.Random(1).shuffle(arrival)
    by_length = sorted(ids, key=len)
    plans = {
        "sorted 8": [by_length[i : i + 8] for i in range(0, len(by_length), 8)],
        "cap 0.1": capped(arrival, 0.1),
        "cap 0.3": capped(arrival, 0.3),
        "cap 1.0 (32)": capped(arrival, 1.0),
        "one": [[r] for r in ids[:400]],
    }
    for name, batches in plans.items():
        feeds = [padded(b) for b in batches]
        padding = 1 - sum(int(m.sum()) for _, m in feeds) / sum(m.size for _, m in feeds)
        rates: dict[str, list[float]] = {"fused": [], "unpadded": []}
        for _ in range(3):
            for label, s in (("fused", fused), ("unpadded", unpadded)):
                t = time.perf_counter()
                for a, m in feeds:
                    s.run(None, {"input_ids": a, "attention_mask": m})
                rates[label].append(sum(map(len, batches)) / (time.perf_counter() - t))
        f, u = max(rates["fused"]), max(rates["unpadded"])
        print(
            f"{name:12s} mean batch {np.mean([len(b) for b in batches]):5.1f} padding {padding:5.1%}  "
            f"fused {f:6.1f}  unpadded {u:6.1f} seq/s  ratio {u / f:.3f}"
        )


main()
