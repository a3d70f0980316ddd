"""Does the event loop at a lower OS priority than ONNX Runtime's threads serve more under load?

Hypothesis: ONNX Runtime's two intra-op threads meet at a barrier after every operator, so when the event
loop (or gRPC's threads) takes a core from one of them mid-run, the other waits at the barrier: the
loop's CPU costs the model twice. At a higher nice, the loop would run more of its work between batches.

Each round starts the server afresh (defaults, the fused graph) in each configuration, alternated:
- as shipped;
- nice5 (niceN): after warm-up, every thread of the server but the inference thread and ONNX Runtime's
  pool thread set to nice N (the pool thread: the unnamed thread, not the main one, with the most CPU);
- batch: the same threads set to SCHED_BATCH instead (same share of the CPU, no preemption on wake-up).
Measured: one client's p50 over gRPC and HTTP (300 short texts), then 32 closed-loop clients for SECONDS
each over gRPC and HTTP, with ab_turns.py's loops (imported). Once per round, ONNX Runtime in process one text at a
time. Run from the repository root (raising a thread's nice value, or moving it to SCHED_BATCH, needs no
privilege): python docs/bench/2026-11-26-nice/nice_ab.py ROUNDS SECONDS CONFIG...
"""

import asyncio
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # docs/bench: one_client.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-turns"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-floor"))
from ab_turns import LONE, grpc_32, measure
from one_client import in_process, p50_ms
from threads import per_thread

from mhaserve.testing.loopback import free_port
from mhaserve.testing.process import ServerProcess


def renice(pid: int, config: str) -> list[str]:
    """Every thread but the inference thread and ONNX Runtime's pool thread to `config` ("nice5": nice 5,
    "batch": SCHED_BATCH, which never preempts a running thread when it wakes); what was left alone."""
    ts = [(int(tid), name, user + system) for (tid, name), (user, system, _) in per_thread(pid).items()]
    main_name = next(name for tid, name, _ in ts if tid == pid)
    pool = [t for t in ts if t[0] != pid and t[1] == main_name]
    kept = {t[0] for t in ts if t[1] == "inference"} | ({max(pool, key=lambda t: t[2])[0]} if pool else set())
    for tid, _, _ in ts:
        if tid in kept:
            continue
        if config == "batch":
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, tid, int(config.removeprefix("nice")))
    return [f"{name}:{cpu:.1f}s" for tid, name, cpu in ts if tid in kept]


def served(config: str, seconds: float) -> dict[str, float]:
    port = free_port()
    flags = ["--repository", "models", "--graph", "optimized", "--port", "0", "--metrics-port", "0",
             "--http-port", str(port)]  # fmt: skip
    with ServerProcess(flags, Path("/tmp/nice-ab-serve.log")) as server:
        address = server.wait_serving()
        asyncio.run(grpc_32(address, 2.0))  # warm up, so that the pool thread has CPU to be found by
        if config != "as-shipped":
            kept = renice(server.pid, config)
            print(f"  {config}: left alone: {', '.join(kept)}", flush=True)
        got = measure(address, port, seconds)
        server.signal()
        server.wait()
    return got


def main(rounds: int, seconds: float, others: list[str]) -> None:
    configs = ["as-shipped", *others]
    rows: dict[str, dict[str, list[float]]] = {c: {} for c in configs}
    refs: list[float] = []
    one_text = in_process()
    for r in range(rounds):
        for config in configs if r % 2 == 0 else reversed(configs):
            got = served(config, seconds)
            for k, v in got.items():
                rows[config].setdefault(k, []).append(v)
            print(f"round {r} {config}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
        refs.append(p50_ms(one_text, LONE))
        print(f"round {r}: ONNX Runtime in process one text at a time {refs[-1]:.2f} ms", flush=True)
    print(f"medians of {rounds} rounds; in process {statistics.median(refs):.2f} ms")
    for config, row in rows.items():
        ratios = {k: [v / rows["as-shipped"][k][i] for i, v in enumerate(vs)] for k, vs in row.items() if "/s" in k}
        line = f"{config}: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in row.items())
        if config != "as-shipped":
            line += "; against as shipped in the same round: "
            line += ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in ratios.items())
        print(line)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:])
