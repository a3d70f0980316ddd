"""Where a lone HTTP request's time goes, stage by stage: starts stages_server.py (the scripted engine of
the tests, 5 ms asleep a batch, or with MODEL=1 the model's fused graph), sends 200 short texts to warm
up and then 1,000 one at a time from one client (raw HTTP/1.1 on a keep-alive connection, the OpenAI
route), and prints the median of each stage, from the request's bytes in to its body's send.
Run from the repository root: [MODEL=1] python stages.py"""

import statistics
from pathlib import Path

from trace_ab import one_client_on

out = Path("/tmp/stages.tsv")
latencies = one_client_on("stages_server.py", out, Path("/tmp/stages.log"))
requests: list[list[tuple[str, int]]] = []
for line in out.read_text().splitlines():
    name, t = line.split("\t")
    if name == "A bytes in":
        requests.append([])
    if requests:
        requests[-1].append((name, int(t)))
requests = requests[-1000:]
order = [name for name, _ in requests[-1]]
stages: dict[str, list[float]] = {}
for r in requests:
    if [name for name, _ in r] != order:
        continue  # the thread's stamps and the loop's can interleave otherwise; such a request is left out
    for (a, t0), (b, t1) in zip(r, r[1:], strict=False):
        stages.setdefault(f"{a} -> {b}", []).append((t1 - t0) / 1000)
    stages.setdefault("whole: bytes in -> body sent", []).append((r[-1][1] - r[0][1]) / 1000)
print(f"{len(stages['whole: bytes in -> body sent'])} requests in this order; client p50 "
      f"{1000 * statistics.median(latencies):.3f} ms")  # fmt: skip
for stage, values in stages.items():
    print(f"  {stage:<62} {statistics.median(values):8.1f} us")
