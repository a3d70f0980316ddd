"""A lone short text in process on the CPU's two fused graphs, and with the server's overlap session beside.

ONNX Runtime one text at a time (tokeniser counted, as one_client.in_process runs it) on each GRAPH, the first
400 short texts, in alternated rounds, without a pause and with 2 ms idle after each text. `GRAPH+ov` builds
the engine as the server does with two inference workers: a second session of one thread beside the main one,
both on one shared arena (OnnxEngine's `overlap_threads`); a lone text still runs on the main session. Run from
the repository root: python docs/bench/2026-11-30-thirtyfourth/lone_graph.py ROUNDS GRAPH [GRAPH ...]
"""

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from mhaserve.runtime.repository import ModelRepository, onnx_engine

TEXTS = [line for line in Path("loadtest/texts/short.txt").read_text().splitlines() if line.strip()][:400]
PAUSES = (0.0, 0.002)


def runner(spec: str) -> Callable[[str], None]:
    graph, _, overlap = spec.partition("+")
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph=graph)
    engine = onnx_engine("cpu", None, 1 if overlap else None)(entry)
    tok = Tokenizer.from_file(str(entry.tokenizer_path))
    tok.no_padding()
    tok.enable_truncation(256)

    def run(text: str) -> None:
        ids = np.asarray([tok.encode(text).ids], dtype=np.int64)
        engine.run(ids, np.ones_like(ids))

    for text in TEXTS[:50]:
        run(text)
    return run


def p50_ms(run: Callable[[str], None], pause: float) -> float:
    latencies = []
    for text in TEXTS:
        t0 = time.perf_counter()
        run(text)
        latencies.append(time.perf_counter() - t0)
        if pause:
            time.sleep(pause)
    return 1000 * statistics.median(latencies)


def main(rounds: int, specs: list[str]) -> None:
    runs = {spec: runner(spec) for spec in specs}
    got: dict[tuple[str, float], list[float]] = {}
    for r in range(rounds):
        for spec in specs if r % 2 == 0 else specs[::-1]:
            for pause in PAUSES:
                got.setdefault((spec, pause), []).append(p50_ms(runs[spec], pause))
        print(r, {f"{s} p{1000 * p:.0f}": round(v[-1], 2) for (s, p), v in got.items()}, flush=True)
    for key, values in got.items():
        print(key, round(statistics.median(values), 2), [round(v, 2) for v in values])


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
