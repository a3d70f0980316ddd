"""Round trip between two processes over a pipe pair, the sender idle PAUSE s between pings (400 pings).
Run: python docs/bench/2026-11-29-twentythird/wake.py PAUSE  (haltpoll.txt: with the guest's halt polling off and on)
"""

import os
import statistics
import sys
import time

pause = float(sys.argv[1]) if len(sys.argv) > 1 else 0.005
n = 400
a_r, a_w = os.pipe()
b_r, b_w = os.pipe()
pid = os.fork()
if pid == 0:
    for _ in range(n):
        os.read(a_r, 1)
        os.write(b_w, b"x")
    os._exit(0)
rt = []
for _ in range(n):
    time.sleep(pause)
    t = time.perf_counter()
    os.write(a_w, b"x")
    os.read(b_r, 1)
    rt.append(time.perf_counter() - t)
os.waitpid(pid, 0)
print(
    f"pause {pause * 1e3:.1f} ms: round trip p50 {statistics.median(rt) * 1e6:.0f} us, "
    f"p90 {sorted(rt)[int(n * 0.9)] * 1e6:.0f} us"
)
