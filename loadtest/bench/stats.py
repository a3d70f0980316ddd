"""Small figures shared by the benchmark's parts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def latency_summary(latencies_ms: Sequence[float]) -> dict[str, float]:
    """p50, p95, p99 and mean of latencies in milliseconds (zeros when there are none)."""
    if not latencies_ms:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "mean": 0.0, "n": 0}
    a = np.asarray(latencies_ms, dtype=np.float64)
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(a.mean()), "n": int(a.size)}
