"""ONNX Runtime in process, the short texts sorted by length and tokenised as the bench's ceiling does, two ways
taking turns for ROUNDS rounds: the bench's ceiling (one thread calling the engine, batches of 16 and 32 on the
session with both cores), and the server's layout without the server (two threads calling one engine built as
`mhaserve serve` builds it with two inference workers, so that a batch beside another runs on the one-thread
session), in batches of 1 to 8 taken from one queue. What the model can serve on these cores when two batches
compute side by side, against which the server's remaining overhead can be read. Run from the repository root:
  python docs/bench/2026-11-27-eleventh/side_by_side.py ROUNDS
"""

import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eighth"))
from trace_fixed import workload  # noqa: E402

from mhaserve.loadtest.bench.inprocess import _inputs, _pad, batches  # noqa: E402
from mhaserve.runtime.repository import ModelRepository, onnx_engine  # noqa: E402
from mhaserve.runtime.tokenizer import load_for_serving  # noqa: E402


def main(rounds: int) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    engine = onnx_engine("cpu", 2, 1)(entry)  # as the server with two workers on 2 cores: 2 alone, 1 beside
    work = workload("short")
    inputs = _inputs(work, load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len))

    def run(idx: list[int]) -> None:
        ids, mask = _pad(inputs(idx), entry.manifest.pad_id)
        engine.run(ids, mask)

    def one_caller(b: int) -> float:
        plan = batches(work, b)
        t0 = time.perf_counter()
        for idx in plan:
            run(idx)
        return len(work.ids) / (time.perf_counter() - t0)

    def two_callers(b: int) -> float:
        plan = iter(batches(work, b))
        lock = threading.Lock()

        def caller() -> None:
            while True:
                with lock:
                    idx = next(plan, None)
                if idx is None:
                    return
                run(idx)

        threads = [threading.Thread(target=caller) for _ in range(2)]
        before = engine.overlapped_runs
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        overlap_share[b].append((engine.overlapped_runs - before) / len(batches(work, b)))
        return len(work.ids) / seconds

    points = [("one caller", b, one_caller) for b in (16, 32)] + [("two callers", b, two_callers) for b in (1, 2, 4, 8)]
    got: dict[tuple[str, int], list[float]] = {(n, b): [] for n, b, _ in points}
    overlap_share: dict[int, list[float]] = {b: [] for _, b, _ in points}
    run(list(range(64)))  # warm-up
    for r in range(rounds):
        for name, b, how in points if r % 2 == 0 else list(reversed(points)):
            got[(name, b)].append(how(b))
        print(f"round {r}: " + ", ".join(f"{n} b={b} {v[-1]:.1f}" for (n, b), v in got.items()), flush=True)
    ceilings = [max(got[("one caller", 16)][r], got[("one caller", 32)][r]) for r in range(rounds)]
    print(f"medians of {rounds} rounds, seq/s (each round against that round's ceiling, the better one-caller batch):")
    print(f"  ceiling (one caller, best of 16 and 32): {statistics.median(ceilings):.1f}")
    for (name, b), values in got.items():
        ratios = [v / c for v, c in zip(values, ceilings, strict=True)]
        beside = statistics.median(overlap_share[b]) if name == "two callers" else None
        share = "" if beside is None else f", on the one-thread session {beside:.2f}"
        print(f"  {name} b={b}: {statistics.median(values):.1f}, / ceiling {statistics.median(ratios):.3f} "
              f"({', '.join(f'{x:.2f}' for x in ratios)}){share}")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]))
