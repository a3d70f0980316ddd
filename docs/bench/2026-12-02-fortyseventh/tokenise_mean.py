"""The tokeniser's mean and p50 over the bench's short texts, one text at a time, back to back and each after a
4 ms sleep (a lone request's case: the event loop sleeps while the model computes): what the profile's
tokeniser frame, a mean a request, is to be read against. Run from the repository root:
    python docs/bench/2026-12-02-fortyseventh/tokenise_mean.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import workloads_of  # noqa: E402

from mhaserve.runtime.tokenizer import load_for_serving  # noqa: E402

TEXTS = workloads_of(["short"])["short"].texts[:1000]
TOKENIZER = load_for_serving("models/all-minilm-l6-v2/1/tokenizer.json", 256)

for round_ in range(3):
    for gap in (0.0, 0.004):
        took = []
        for text in TEXTS:
            if gap:
                time.sleep(gap)
            start = time.perf_counter()
            TOKENIZER.encode(text)
            took.append(time.perf_counter() - start)
        print(f"round {round_}: {'after 4 ms asleep' if gap else 'no gap           '}  "
              f"mean {statistics.mean(took) * 1e6:6.1f} us, p50 {statistics.median(took) * 1e6:6.1f} us")  # fmt: skip
