"""A thread hand-off and back, after the machine idled 6 ms (as a lone request's path meets it), and back to back."""
import statistics, threading, time, sys
req, rep = threading.Event(), threading.Event()
def worker():
    while True:
        req.wait(); req.clear(); rep.set()
threading.Thread(target=worker, daemon=True).start()
def run(idle, n=2000):
    out = []
    for _ in range(n):
        if idle: time.sleep(idle)
        t = time.perf_counter(); req.set(); rep.wait(); rep.clear(); out.append((time.perf_counter() - t) * 1e6)
    out.sort(); return out[len(out)//2], out[int(len(out)*.9)]
for r in range(3):
    print("round", r, "idle 6 ms: p50 %.0f us p90 %.0f us" % run(0.006, 1000), "| back to back: p50 %.0f us p90 %.0f us" % run(0, 5000))
