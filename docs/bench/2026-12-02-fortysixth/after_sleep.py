"""A short text's tokenisation, and a few microseconds of plain Python, right after the thread slept 4 ms, against
the same with no sleep and after a 4 ms busy wait: how much slower a lone request's first work runs on this VM
after an idle (the one-client case: the event loop sleeps while the model computes). Run from the repository
root:
    python docs/bench/2026-12-02-fortysixth/after_sleep.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import workloads_of  # noqa: E402

from mhaserve.runtime.tokenizer import load_for_serving  # noqa: E402

TEXTS = workloads_of(["short"])["short"].texts[:600]
TOKENIZER = load_for_serving("models/all-minilm-l6-v2/1/tokenizer.json", 256)


def timed(work, gap: float, busy: bool) -> float:  # type: ignore[no-untyped-def]
    """p50 in microseconds of `work(text)` over TEXTS, each after `gap` seconds asleep (or busy)."""
    took = []
    for text in TEXTS:
        if busy:
            end = time.perf_counter() + gap
            while time.perf_counter() < end:
                pass
        elif gap:
            time.sleep(gap)
        t = time.perf_counter()
        work(text)
        took.append(time.perf_counter() - t)
    return statistics.median(took) * 1e6


def main() -> None:
    works = {"tokenizer.encode(text)": TOKENIZER.encode, "sum(range(300))": lambda _: sum(range(300))}
    ways = (("no gap", 0.0, False), ("after 4 ms asleep", 0.004, False), ("after 4 ms busy", 0.004, True))
    for round_ in range(3):
        for name, work in works.items():
            cells = [f"{label} {timed(work, gap, busy):6.1f} us" for label, gap, busy in ways]
            print(f"round {round_}: {name:24s} p50 " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
