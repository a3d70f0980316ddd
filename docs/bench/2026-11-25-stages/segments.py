"""Per-segment medians of /tmp/trace.txt, written by a server with trace.patch applied and one client
(requests strictly one after another, so each request's events follow its "A")."""

import collections
import statistics

requests: list[list[tuple[str, int]]] = []
with open("/tmp/trace.txt") as f:
    for line in f:
        label, stamp = line.split()
        if label == "A":
            requests.append([])
        if requests:
            requests[-1].append((label, int(stamp)))

segments: dict[str, list[float]] = collections.defaultdict(list)
for events in requests[30:]:  # the warm-up calls
    if [label for label, _ in events].count("A") != 1:
        continue
    for (a, ta), (b, tb) in zip(events, events[1:], strict=False):
        segments[f"{a}->{b}"].append((tb - ta) / 1000)
    segments["total A->K"].append((events[-1][1] - events[0][1]) / 1000)
for name, values in segments.items():
    median, mean = statistics.median(values), statistics.mean(values)
    print(f"{name:12s} n={len(values):4d} median {median:8.1f} us  mean {mean:8.1f}")
