"""The table of docs/benchmarks.md's section on processes that share the cores, from the six reports here.
Run from the repository root: python docs/bench/2026-11-26-share/table.py"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
CONFIGS = {"p1": "1 process (default)", "pinned": "2 processes, pinned", "shared": "2 processes, sharing the cores"}


def one_at_a_time_p50(report: dict) -> float:
    return report["inprocess"]["short"]["one_at_a_time"]["latency_ms"]["p50"]


def run(cfg: str, run: str) -> dict:
    return json.loads((HERE / f"2core-{cfg}-{run}" / "report.json").read_text())


for cfg, name in CONFIGS.items():
    rounds = {"grpc/ceiling": [], "http/ceiling": []}
    one = {"grpc": [], "http": []}
    batch = []
    for r in "ab":
        report = run(cfg, r)
        for rnd in report["paired_short"]["rounds"]:
            for k in rounds:
                rounds[k].append(rnd["ratios"][k])
        ref = one_at_a_time_p50(report)
        grpc = {p["concurrency"]: p for p in report["server"]["length"]["short"]}
        http = {p["concurrency"]: p for p in report["http"]["protocols"]["http"]["short"]}
        one["grpc"].append(grpc[1]["latency_ms"]["p50"] - ref)
        one["http"].append(http[1]["latency_ms"]["p50"] - ref)
        batch.append(grpc[32]["mean_batch_size"])
    print(f"{name}:")
    for k, v in rounds.items():
        print(f"  {k}: rounds {', '.join(f'{x:.2f}' for x in v)}; median {statistics.median(v):.2f}")
    for k, v in one.items():
        gaps = ", ".join(f"{x:+.2f}" for x in v)
        print(f"  one client over {k}, p50 over ONNX Runtime one text at a time: {gaps} ms")
    print(f"  mean batch at 32 clients (gRPC): {', '.join(f'{x:.1f}' for x in batch)}")
