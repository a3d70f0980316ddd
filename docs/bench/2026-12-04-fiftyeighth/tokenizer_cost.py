"""What the served tokenizer costs a short text, in CPU: one text a call (as the server tokenises a short
request, on its event loop) against `encode_batch` of 4 and 16 (which lets go of the GIL and spreads over
the tokenizer's own threads), and the normaliser and pre-tokeniser alone. Over the short workload's first
2,000 texts, three passes. From the repository root:
    python docs/bench/2026-12-04-fiftyeighth/tokenizer_cost.py [RAYON_NUM_THREADS]
"""

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if len(sys.argv) > 1:
    os.environ["RAYON_NUM_THREADS"] = sys.argv[1]  # before the tokenizer's pool starts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import workloads_of  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

texts = list(workloads_of(["short"])["short"].texts)[:2000]
tokenizer = Tokenizer.from_file("models/all-minilm-l6-v2/1/tokenizer.json")  # as published: no padding, 256


def per_text(run: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return (time.perf_counter() - wall) / len(texts) * 1e6, (time.process_time() - cpu) / len(texts) * 1e6


for rep in range(3):
    cases = {
        "encode, one text a call": lambda: [tokenizer.encode(t) for t in texts],
        "encode_batch of 4": lambda: [tokenizer.encode_batch(texts[i : i + 4]) for i in range(0, len(texts), 4)],
        "encode_batch of 16": lambda: [tokenizer.encode_batch(texts[i : i + 16]) for i in range(0, len(texts), 16)],
        "the normaliser alone": lambda: [tokenizer.normalizer.normalize_str(t) for t in texts],
        "the pre-tokeniser alone": lambda: [tokenizer.pre_tokenizer.pre_tokenize_str(t) for t in texts],
    }
    for name, run in cases.items():
        wall, cpu = per_text(run)
        print(f"pass {rep}: {name}: {wall:.1f} us a text of wall time, {cpu:.1f} us of CPU")
