"""A lone short text in process on the CPU's two fused graphs, and with the server's overlap session beside.

ONNX Runtime one text at a time (tokeniser counted: one_client.in_process) on each GRAPH, the first 400 short
texts, in alternated rounds, without a pause and with 2 ms idle after each text. `GRAPH+ov` builds the engine
as the server does with two inference workers: a second session of one thread beside the main one, both on
one shared arena (OnnxEngine's `overlap_threads`); a lone text still runs on the main session. Run from the
repository root: python docs/bench/2026-11-30-thirtyfourth/lone_graph.py ROUNDS GRAPH [GRAPH ...]
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import SHORT_TEXTS, in_process, latencies  # noqa: E402

TEXTS = SHORT_TEXTS[:400]
PAUSES = (0.0, 0.002)


def main(rounds: int, specs: list[str]) -> None:
    runs = {}
    for spec in specs:
        graph, _, overlap = spec.partition("+")
        runs[spec] = in_process(graph, 1 if overlap else None)
        latencies(runs[spec], TEXTS[:50])  # warm-up
    got: dict[tuple[str, float], list[float]] = {}
    for r in range(rounds):
        for spec in specs if r % 2 == 0 else specs[::-1]:
            for pause in PAUSES:
                got.setdefault((spec, pause), []).append(1000 * statistics.median(latencies(runs[spec], TEXTS, pause)))
        print(r, {f"{s} p{1000 * p:.0f}": round(v[-1], 2) for (s, p), v in got.items()}, flush=True)
    for key, values in got.items():
        print(key, round(statistics.median(values), 2), [round(v, 2) for v in values])


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
