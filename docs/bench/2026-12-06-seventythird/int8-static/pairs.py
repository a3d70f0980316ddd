import itertools
import sys
import time
from pathlib import Path

import numpy as np

from mhaserve.export import int8_gate as g
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.tokenizer import load_for_serving

d = Path("models/all-minilm-l6-v2/1")
tok = load_for_serving(d / "tokenizer.json", 256)
texts = g.fidelity_texts() + [q for q, _ in g.retrieval_set()]
enc = [e.ids for e in tok.encode_batch(texts)]
ref_e = OnnxEngine(d / "model.optimized.onnx", max_seq_len=256, vocab_size=30522, device="cpu")
ref = np.concatenate([ref_e.run(*g._pad([r], 0)) for r in enc])
print(len(texts), "texts")
for cand in sys.argv[1:]:
    c = OnnxEngine(Path(cand), max_seq_len=256, vocab_size=30522, device="cpu", intra_op_threads=1)
    t = time.time()
    worst = []
    for i, j in itertools.combinations(range(len(enc)), 2):
        out = c.run(*g._pad([enc[i], enc[j]], 0))
        cs = g._cosines(ref[[i, j]], out)
        worst.append((cs[0], texts[i][:30], texts[j][:30]))
        worst.append((cs[1], texts[j][:30], texts[i][:30]))
    worst.sort()
    print(cand, f"{time.time() - t:.0f}s", "below .98:", sum(w[0] < 0.98 for w in worst), "of", len(worst))
    for w in worst[:5]:
        print("  ", round(w[0], 5), w[1:])
