"""One short text at a time on one intra-op thread against two, with the server's session options, and a 1 ms
gap between calls as a lone client leaves; alternated rounds of 300 texts, the tokeniser counted.

Run from the repository root: `.venv/bin/python docs/bench/2026-12-05-sixtythird/one_or_two_threads.py 6`.
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from mhaserve.runtime.engine import _session_options

VERSION = Path("models/all-minilm-l6-v2/1")
tokenizer = Tokenizer.from_file(str(VERSION / "tokenizer.json"))
tokenizer.no_padding()
tokenizer.enable_truncation(256)
texts = [t.strip() for t in Path("loadtest/texts/short.txt").read_text().splitlines() if t.strip()][:300]
sessions = {
    n: ort.InferenceSession(
        str(VERSION / "model.optimized-cpu.onnx"),
        sess_options=_session_options(n, 1),
        providers=["CPUExecutionProvider"],
    )
    for n in (1, 2)
}
names = {i.name for i in sessions[1].get_inputs()}


def one(session: ort.InferenceSession, text: str) -> None:
    encoding = tokenizer.encode(text)
    ids = np.asarray([encoding.ids], dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.asarray([encoding.attention_mask], dtype=np.int64)}
    if "token_type_ids" in names:
        feed["token_type_ids"] = np.zeros_like(ids)
    session.run(None, feed)


for session in sessions.values():
    for text in texts[:30]:
        one(session, text)
p50s: dict[int, list[float]] = {1: [], 2: []}
for r in range(int(sys.argv[1])):
    for n in (1, 2) if r % 2 == 0 else (2, 1):
        took = []
        for text in texts:
            start = time.perf_counter()
            one(sessions[n], text)
            took.append(time.perf_counter() - start)
            time.sleep(0.001)  # the gap a lone client leaves between calls
        p50s[n].append(statistics.median(took) * 1e3)
    print(r, {n: round(v[-1], 2) for n, v in p50s.items()}, flush=True)
print("median of rounds", {n: round(statistics.median(v), 2) for n, v in p50s.items()})
