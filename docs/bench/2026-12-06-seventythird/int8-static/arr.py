"""Min cosine of int8 vs fp32 over server-like arrangements: texts sorted by length, consecutive batches of
size k (k=2..16) under a token budget, several offsets."""

import sys
from pathlib import Path

import numpy as np

from mhaserve.export import int8_gate as g
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.tokenizer import load_for_serving

d = Path(sys.argv[1])
cand = sys.argv[2] if len(sys.argv) > 2 else "model.int8.onnx"
ref_e = OnnxEngine(d / "model.optimized.onnx", max_seq_len=256, vocab_size=30522, device="cpu")
c_e = OnnxEngine(d / cand, max_seq_len=256, vocab_size=30522, device="cpu")
tok = load_for_serving(d / "tokenizer.json", 256)
items = g.retrieval_set()
texts = g.fidelity_texts() + [q for q, _ in items] + [p for _, ps in items for p in ps]
enc = [e.ids for e in tok.encode_batch(texts)]
ref = np.concatenate([ref_e.run(*g._pad([r], 0)) for r in enc])
order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
worst = []
for k in (2, 3, 4, 6, 8, 12, 16):
    for off in range(0, k):
        idxs = order[off:]
        b = 0
        mins = []
        while b < len(idxs):
            chunk = idxs[b : b + k]
            out = c_e.run(*g._pad([enc[i] for i in chunk], 0))
            cs = g._cosines(ref[chunk], out)
            for i, c in zip(chunk, cs, strict=True):
                worst.append((float(c), k, texts[i][:40]))
            b += k
        if off >= 2:
            break
worst.sort()
print("n", len(worst), "below 0.98:", sum(1 for w in worst if w[0] < 0.98))
for w in worst[:12]:
    print(w)
