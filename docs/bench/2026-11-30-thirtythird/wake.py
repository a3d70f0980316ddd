"""A thread's hand-off and back on this VM: after the machine idled 6 ms (as a lone request meets it), and back to back.

Two Python threads and an Event each way, as the server's event loop and an inference worker hand a batch over
and back. Run as `python docs/bench/2026-11-30-thirtythird/wake.py`; prints the p50 and p90 round trip.
"""

import threading
import time

request, reply = threading.Event(), threading.Event()


def worker() -> None:
    while True:
        request.wait()
        request.clear()
        reply.set()


def round_trips(idle_s: float, n: int) -> tuple[float, float]:
    """p50 and p90 of `n` round trips in microseconds, each after `idle_s` asleep."""
    out = []
    for _ in range(n):
        if idle_s:
            time.sleep(idle_s)
        t = time.perf_counter()
        request.set()
        reply.wait()
        reply.clear()
        out.append((time.perf_counter() - t) * 1e6)
    out.sort()
    return out[len(out) // 2], out[int(len(out) * 0.9)]


def main() -> None:
    threading.Thread(target=worker, daemon=True).start()
    for r in range(3):
        i50, i90 = round_trips(0.006, 1000)
        b50, b90 = round_trips(0, 5000)
        print(f"round {r} idle 6 ms: p50 {i50:.0f} us p90 {i90:.0f} us", end=" | ")
        print(f"back to back: p50 {b50:.0f} us p90 {b90:.0f} us")


if __name__ == "__main__":
    main()
