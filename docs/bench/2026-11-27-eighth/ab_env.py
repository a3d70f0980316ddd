"""ab_workers.py on short, mixed and fixed texts, with configurations that may differ by environment variables:
a flag `ENV:NAME=VALUE` is not passed to the server but set in its environment (for an experiment kept behind
a variable that the committed code does not read). Run from the repository root:
  python docs/bench/2026-11-27-eighth/ab_env.py ROUNDS SECONDS base= gather=ENV:MHASERVE_GATHER=1
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-workers"))
import ab_workers  # noqa: E402

from mhaserve.loadtest.bench.workloads import build  # noqa: E402

ab_workers.POINTS = [("short", "grpc", 1), ("short", "grpc", 32), ("short", "http", 32), ("mixed", "grpc", 32),
                     ("mixed", "http", 32), ("fixed", "grpc", 32), ("fixed", "http", 32)]  # fmt: skip
measure = ab_workers.measure


def workloads(kinds, tokenizer, **kw):  # type: ignore[no-untyped-def]
    return build(["short", "mixed", "fixed"], tokenizer, **kw)


def measure_with_env(flags, workloads, seconds):  # type: ignore[no-untyped-def]
    env = dict(f[4:].split("=", 1) for f in flags if f.startswith("ENV:"))
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return measure(tuple(f for f in flags if not f.startswith("ENV:")), workloads, seconds)
    finally:
        os.environ.clear()
        os.environ.update(saved)


ab_workers.build = workloads
ab_workers.measure = measure_with_env

if __name__ == "__main__":
    ab_workers.cli(sys.argv[1:])
