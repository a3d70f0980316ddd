"""Garbage collection pauses by generation, summed and written to /tmp/gc-PID.txt at exit. Installed for
one run as a .pth hook in the virtual environment (so that the server's process loads it too), then
removed:

    cp docs/bench/2026-11-25-stages/gc_pauses.py .venv/lib/python3.11/site-packages/zz_gc_pauses.py
    echo "import zz_gc_pauses" > .venv/lib/python3.11/site-packages/zz_gc_pauses.pth
"""

import atexit
import gc
import os
import time

_started: dict[int, float] = {}
_totals = {g: [0, 0.0, 0.0] for g in (0, 1, 2)}  # collections, seconds, longest


def _callback(phase: str, info: dict[str, int]) -> None:
    generation = info["generation"]
    if phase == "start":
        _started[generation] = time.perf_counter()
        return
    took = time.perf_counter() - _started.pop(generation, time.perf_counter())
    totals = _totals[generation]
    totals[0] += 1
    totals[1] += took
    totals[2] = max(totals[2], took)


gc.callbacks.append(_callback)


@atexit.register
def _dump() -> None:
    with open(f"/tmp/gc-{os.getpid()}.txt", "w") as f:
        for generation, (n, seconds, longest) in _totals.items():
            f.write(f"gen{generation}: {n} collections, {1000 * seconds:.1f} ms total, max {1000 * longest:.2f} ms\n")
