"""The in-process reference of issue 18's one-client target, run back to back (as the target defines it)
and with the thread idle between texts, as a served model's thread is while the request travels.

ONNX Runtime in this process, one short text at a time (tokeniser counted; one_client.in_process): the
p50 of 600 texts with no pause, and with a pause of 1, 2 and 5 ms after each, alternated in rounds.
Run from the repository root: python docs/bench/2026-11-26-floor/idle_model.py ROUNDS
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
from one_client import SHORT_TEXTS, in_process

PAUSES_MS = [0, 1, 2, 5]


def p50_ms(run, pause: float) -> float:  # type: ignore[no-untyped-def]
    latencies = []
    for text in SHORT_TEXTS[:600]:
        t0 = time.perf_counter()
        run(text)
        latencies.append(time.perf_counter() - t0)
        if pause:
            time.sleep(pause)
    return 1000 * statistics.median(latencies)


def main() -> None:
    run = in_process()
    for text in SHORT_TEXTS[:100]:
        run(text)
    results: dict[int, list[float]] = {p: [] for p in PAUSES_MS}
    for r in range(int(sys.argv[1])):
        for pause in PAUSES_MS if r % 2 == 0 else list(reversed(PAUSES_MS)):
            results[pause].append(p50_ms(run, pause / 1000))
        print(f"round {r}: " + ", ".join(f"pause {p} ms: {v[-1]:.2f}" for p, v in results.items()), flush=True)
    print("medians: " + ", ".join(f"pause {p} ms: {statistics.median(v):.2f} ms" for p, v in results.items()))


if __name__ == "__main__":
    main()
