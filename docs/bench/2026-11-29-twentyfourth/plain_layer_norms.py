"""The fused fp32 graph against the same graph with its 12 SkipLayerNormalization nodes written as plain
operators (the int8 graph's rewrite since 2026-11-24; since the twenty-fifth session export/layer_norms.py's
`cpu_graph`, which the export publishes as optimized-cpu), in process on the
first 400 short texts sorted by length, in batches of 1, 4 and 16; one intra-op thread (CPU time of the
calling thread) and two (wall clock); 3 rounds, interleaved as the export's speed figures are (export/speed.py).
Run from the repository root:
  python docs/bench/2026-11-29-twentyfourth/plain_layer_norms.py
"""

import tempfile
from pathlib import Path

from mhaserve.export.layer_norms import cpu_graph
from mhaserve.export.speed import batches, interleaved
from mhaserve.loadtest.bench.workloads import load_corpus
from mhaserve.loadtest.texts import SHORT
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving


def main() -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    m = entry.manifest
    tokenizer = load_for_serving(entry.tokenizer_path, m.max_seq_len)
    rows = [e.ids for e in tokenizer.encode_batch(load_corpus(SHORT)[:400])]
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "plain.onnx"
        print(f"rewrote {cpu_graph(entry.graph_path, plain)} SkipLayerNormalization nodes")
        for threads in (1, 2):
            engines = {
                name: OnnxEngine(
                    path, max_seq_len=m.max_seq_len, vocab_size=m.vocab_size, device="cpu", intra_op_threads=threads
                )  # fmt: skip
                for name, path in (("fused", entry.graph_path), ("plain", plain))
            }
            for size in (1, 4, 16):
                work = batches(rows, size, pad_id=m.pad_id)
                got = interleaved(engines, work, rounds=3, cpu_clock=threads == 1)["plain"]
                each = f"{got['speed_min']:.3f}-{got['speed_max']:.3f}"
                print(f"{threads} thread(s), batches of {size}: plain x fused {got['speed']:.3f} ({each})")


if __name__ == "__main__":
    main()
