"""Two processes that each wake every STEP s and spin WORK s: keeps both vCPUs from idling long.
Run: python docs/bench/2026-11-29-twentythird/ticker.py STEP WORK  (sporadic_ticker.py starts and kills it)
"""

import os
import sys
import time

step, work = float(sys.argv[1]), float(sys.argv[2])
if os.fork() == 0:
    pass  # two processes: one per vCPU, left to the scheduler
while True:
    time.sleep(step)
    e = time.perf_counter() + work
    while time.perf_counter() < e:
        pass
