"""What one wake-up costs on this machine: the CPU a thread spends to sleep 5 ms and wake, 1,000 times.

Run: python docs/bench/2026-11-26-floor/sleep_cost.py [ROUNDS]
"""

import sys
import threading
import time


def sleeps(out: list[tuple[float, float]], n: int = 1000) -> None:
    cpu0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(n):
        time.sleep(0.005)
    out.append(((time.thread_time() - cpu0) / n, (time.perf_counter() - t0) / n))


for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    result: list[tuple[float, float]] = []
    thread = threading.Thread(target=sleeps, args=(result,))
    thread.start()
    thread.join()
    cpu, wall = result[0]
    print(f"a 5 ms sleep: {cpu * 1e6:.0f} us of the thread's CPU, {wall * 1e3:.3f} ms of wall time")
