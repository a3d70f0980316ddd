import sys
from pathlib import Path

from mhaserve.export import int8_gate as g
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.tokenizer import load_for_serving

d = Path("models/all-minilm-l6-v2/1")
ref = OnnxEngine(d / "model.optimized.onnx", max_seq_len=256, vocab_size=30522, device="cpu")
tok = load_for_serving(d / "tokenizer.json", 256)
for cand in sys.argv[1:]:
    r = g.check(
        ref,
        OnnxEngine(Path(cand), max_seq_len=256, vocab_size=30522, device="cpu"),
        tok,
        max_seq_len=256,
        vocab_size=30522,
        pad_id=0,
    )
    print(
        cand,
        "passed" if r.passed else r.failures,
        f"min {r.min_cosine:.5f} alone {r.min_cosine_alone:.5f} batched {r.min_cosine_batched:.5f} "
        f"mean {r.mean_cosine:.5f}",
        r.worst_input,
        {k: round(v, 3) for k, v in r.retrieval.items()},
    )
