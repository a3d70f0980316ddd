"""ab_workers.py on the fixed workload (one input of exactly 128 tokens per request, sent as ids): one client's
p50, then 32 gRPC and 32 HTTP clients (seq/s, p50, p99), each configuration started afresh every round,
alternated. The "no regression" check of the default's change from one inference worker to two on 2 cores.
Run from the repository root:
  python docs/bench/2026-11-27-workers/ab_fixed.py ROUNDS SECONDS 1w=--inference-workers=1 2w=
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-workers"))
import ab_workers  # noqa: E402

from mhaserve.loadtest.bench.workloads import build  # noqa: E402

ab_workers.POINTS = [("fixed", "grpc", 1), ("fixed", "grpc", 32), ("fixed", "http", 32)]


def workloads(kinds, tokenizer, **kw):  # type: ignore[no-untyped-def]
    return build(["fixed"], tokenizer, **kw)


ab_workers.build = workloads

if __name__ == "__main__":
    pairs = (arg.partition("=") for arg in sys.argv[3:])
    parsed = {name: tuple(f for f in flags.split(",") if f) for name, _, flags in pairs}
    ab_workers.main(int(sys.argv[1]), float(sys.argv[2]), parsed)
