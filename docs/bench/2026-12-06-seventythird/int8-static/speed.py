import sys
import time
from pathlib import Path

from mhaserve.export import int8_gate as g
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.tokenizer import load_for_serving

d = Path("models/all-minilm-l6-v2/1")
tok = load_for_serving(d / "tokenizer.json", 256)
texts = Path("loadtest/texts/short.txt").read_text().splitlines()[:400]
enc = [e.ids for e in tok.encode_batch(texts)]
engines = {
    p: OnnxEngine(Path(p), max_seq_len=256, vocab_size=30522, device="cpu", intra_op_threads=1) for p in sys.argv[1:]
}
order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
for bs in (1, 16):
    batches = [g._pad([enc[i] for i in order[k : k + bs]], 0) for k in range(0, len(order), bs)]
    tot = {p: 0.0 for p in engines}
    for _round in range(4):
        for p, e in engines.items():
            t = time.process_time()
            for b in batches:
                e.run(*b)
            tot[p] += time.process_time() - t
    base = tot[sys.argv[1]]
    print("batch", bs, {p: round(base / v, 3) for p, v in tot.items()})
