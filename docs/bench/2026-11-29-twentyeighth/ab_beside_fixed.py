"""`beside` (5bca904) against 023f169 on the fixed (128 tokens, sent as ids) and mixed workloads, alternated:
issue 18's "no regression" check for this session's change to how a batch's threads are chosen.

ab_beside.py's measure and setup (BASE: a checkout of 023f169 in a venv of its own), with the defaults
(`--graph auto`); each version serves the mixed points (one gRPC client's p50, 32 gRPC and 32 HTTP clients)
and then, from a fresh start, the fixed one (32 gRPC clients). Run from the repository root:
    python docs/bench/2026-11-29-twentyeighth/ab_beside_fixed.py /tmp/base/.venv/bin/python ROUNDS SECONDS
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
import regress  # noqa: E402
from ab_beside import measure  # noqa: E402

POINTS = {
    "mixed": [("mixed", "grpc", 32), ("mixed", "http", 32), ("mixed", "grpc", 1)],
    "fixed": [("fixed", "grpc", 32)],
}


def main(base: str, rounds: int, seconds: float) -> None:
    workloads = regress.workloads_of(["fixed", "mixed"])

    def one(python: str) -> dict[str, float]:
        out = {}
        for name, points in POINTS.items():
            got = measure(python, workloads, seconds, points=points)
            out.update({f"{name} {k}": v for k, v in got.items()})
        return out

    rows = regress.alternate({"base": lambda: one(base), "beside": lambda: one(sys.executable)}, rounds)
    regress.print_ratios(rows, "base", "beside", rounds)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
