"""The CPU's two fused fp32 graphs served against each other, alternated, a lone request as well as 32 clients.

`--graph auto` serves `optimized-cpu` on a CPU, chosen on the Zen 5 draw (AVX-512) for 1.09-1.12x the texts a
second at 32 clients. On the Zen 3 draw (AVX2 only) the twenty-sixth session's regress.py, run this session,
put a lone text behind the fused graph's on the same code. This is ab_env.py (ab_workers.py's variant with
the fixed workload) with one client on each protocol and workload beside the 32-client points. Run from the
repository root:
  python docs/bench/2026-11-30-thirtyfourth/ab_graph.py ROUNDS SECONDS fused=--graph=optimized cpu=--graph=optimized-cpu
  python docs/bench/2026-11-30-thirtyfourth/ab_graph.py lone ROUNDS SECONDS fused=--graph=optimized cpu=...
(`lone`: the one-client points only, short and mixed texts over both protocols.)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eighth"))
import ab_env  # noqa: E402

ab_env.ab_workers.POINTS = [
    ("short", "grpc", 1),
    ("short", "http", 1),
    ("mixed", "http", 1),
    ("fixed", "http", 1),
    ("short", "grpc", 32),
    ("short", "http", 32),
    ("mixed", "http", 32),
    ("fixed", "http", 32),
]

LONE = [("short", "grpc", 1), ("short", "http", 1), ("mixed", "grpc", 1), ("mixed", "http", 1)]

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] == "lone":
        ab_env.ab_workers.POINTS = LONE
        args = args[1:]
    ab_env.ab_workers.cli(args)
