"""One client's p50 on 128-token inputs (the fixed workload) and on short texts, two server configurations
alternated, each started afresh every round: ab_workers.py's measurement at one client only. Asked because
the tenth session's full run read the fixed workload's one-client p50 2.66 ms above ONNX Runtime one input
at a time, against 0.99 ms in the 2026-11-23 run (one inference worker then).
Run from the repository root:
  python docs/bench/2026-11-27-tenth/ab_one_client.py ROUNDS SECONDS 2w= 1w=--inference-workers=1
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-workers"))
import ab_workers  # noqa: E402

ab_workers.POINTS = [("fixed", "grpc", 1), ("short", "grpc", 1)]
_build = ab_workers.build
ab_workers.build = lambda names, *a, **k: _build(["fixed", "short"], *a, **k)  # type: ignore[assignment]

if __name__ == "__main__":
    ab_workers.cli(sys.argv[1:])
