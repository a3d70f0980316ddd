"""The fused fp32 graph against the same graph with its 12 SkipLayerNormalization nodes written as plain
operators (export/quantize.py's rewrite, which the int8 graph has had since 2026-11-24), in process on the
first 400 short texts sorted by length, in batches of 1, 4 and 16; one intra-op thread (CPU time of the
calling thread) and two (wall clock); 3 alternated rounds, after one unmeasured. Run from the repository root:
  python docs/bench/2026-11-29-twentyfourth/plain_layer_norms.py
"""

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from tokenizers import Tokenizer

from mhaserve.export.quantize import MS, _plain_layer_norm
from mhaserve.loadtest.bench.workloads import load_corpus
from mhaserve.loadtest.texts import SHORT

MODEL = Path("models/all-minilm-l6-v2/1")
Batch = tuple[np.ndarray, np.ndarray]


def rewrite(src: Path, dst: Path) -> int:
    model = ir.load(str(src))
    axes = ir.Value(name="layernorm_axes", const_value=ir.tensor(np.array([-1], dtype=np.int64), name="layernorm_axes"))
    model.graph.register_initializer(axes)
    found = [n for n in model.graph if n.op_type == "SkipLayerNormalization" and n.domain == MS]
    for i, node in enumerate(found):
        _plain_layer_norm(model.graph, node, i, axes)
    ir.save(model, str(dst))
    return len(found)


def batches(size: int) -> list[Batch]:
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(256)
    ids = sorted((e.ids for e in tokenizer.encode_batch(load_corpus(SHORT)[:400])), key=len)
    out = []
    for k in range(0, len(ids), size):
        rows = ids[k : k + size]
        width = max(map(len, rows))
        x, mask = np.zeros((len(rows), width), np.int64), np.zeros((len(rows), width), np.int64)
        for r, row in enumerate(rows):
            x[r, : len(row)], mask[r, : len(row)] = row, 1
        out.append((x, mask))
    return out


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def timed(s: ort.InferenceSession, work: list[Batch], threads: int) -> float:
    clock = time.thread_time if threads == 1 else time.perf_counter
    names = [i.name for i in s.get_inputs()]
    t0 = clock()
    for x, mask in work:
        feed = {n: x if "input_ids" in n else mask if "mask" in n else np.zeros_like(x) for n in names}
        s.run(None, feed)
    return clock() - t0


def main() -> None:
    fused = MODEL / "model.optimized.onnx"
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "plain.onnx"
        print(f"rewrote {rewrite(fused, plain)} SkipLayerNormalization nodes")
        for threads in (1, 2):
            a, b = session(fused, threads), session(plain, threads)
            for size in (1, 4, 16):
                work = batches(size)
                timed(a, work, threads), timed(b, work, threads)
                ratios = [timed(a, work, threads) / timed(b, work, threads) for _ in range(3)]
                each = ", ".join(f"{r:.3f}" for r in ratios)
                print(f"{threads} thread(s), batches of {size}: plain x fused {statistics.median(ratios):.3f} ({each})")


if __name__ == "__main__":
    main()
