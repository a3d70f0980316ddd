"""`make reliability`: the long versions of the reliability scenarios, and docs/reliability.md.

Runs against a real model of the repository (all-MiniLM-L6-v2 by default): in this process where a
scenario must look inside the server (deadlines, faults), as a real `mhaserve serve` process where it
measures the process or signals it (overload, soak, shutdown). Every check is also judged here: the
exit status is 1 if any failed, and the report says which.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mhaserve.loadtest.machine import PACKAGES
from mhaserve.loadtest.machine import machine as describe_machine
from mhaserve.loadtest.reliability.report import render
from mhaserve.loadtest.reliability.results import OVERLOAD_CLIENT_BATCH, Run, Sizes
from mhaserve.loadtest.reliability.scenarios.bad_input import CLIENT_CODES, fuzz
from mhaserve.loadtest.reliability.scenarios.common import HOLD
from mhaserve.loadtest.reliability.scenarios.deadlines import deadlines
from mhaserve.loadtest.reliability.scenarios.faults import POISON, engine_faults, engine_hangs, stuck_engine_exit
from mhaserve.loadtest.reliability.scenarios.load import queue_texts, text_requests
from mhaserve.loadtest.reliability.scenarios.overload import OverloadResult, overload
from mhaserve.loadtest.reliability.scenarios.shutdown import second_signal, shutdown_under_load
from mhaserve.loadtest.reliability.scenarios.soak import soak
from mhaserve.loadtest.reliability.strategies import Model
from mhaserve.runtime.errors import ServiceError
from mhaserve.runtime.manifest import read_manifest
from mhaserve.runtime.repository import ModelRepository, RepositoryError
from mhaserve.service.batching import CPU_LIMITS
from mhaserve.service.settings import Settings
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import free_port
from mhaserve.testing.metrics import scrape
from mhaserve.testing.process import ServerProcess
from mhaserve.testing.server import ServerThread

log = logging.getLogger("reliability")


QUICK = Sizes(
    fuzz_examples=30,
    overload_factors=(5.0,),
    overload_burst=2.0,
    overload_measure=1.5,
    deadline_cycles=2,
    fault_requests=200,
    hang_cycles=1,
    soak_seconds=12.0,
    shutdown_load=1.5,
)
SCENARIOS = ("bad-input", "overload", "deadlines", "faults", "soak", "shutdown")
# The soak's bound on resident-memory growth after warm-up: 1 MiB a minute would be 1.4 GiB a day.
SOAK_BOUND_KIB_PER_MIN = 256.0


def _machine_lines() -> dict[str, str]:
    """The machine as the report lists it."""
    m = describe_machine((*PACKAGES, "hypothesis"))
    packages = m["packages"]
    return {
        "CPU": f"{m['cpu']}, {m['cores']} cores",
        "memory": f"{m['memory_gib']:.0f} GiB" if m["memory_gib"] else "unknown",
        "OS": m["platform"],
        "Python": m["python"],
        "grpcio": packages.get("grpcio", "absent"),
        "onnxruntime": packages.get("onnxruntime-gpu") or packages.get("onnxruntime", "absent"),
        "hypothesis": packages.get("hypothesis", "absent"),
        "commit": m["commit"],
    }


def _timed(run: Run, name: str, scenario: Callable[[], Any]) -> Any:
    log.info("running %s", name)
    t0 = time.perf_counter()
    result = scenario()
    run.seconds[name] = time.perf_counter() - t0
    run.results[name] = result
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhaserve.loadtest.reliability", description=__doc__)
    parser.add_argument("--repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="all-minilm-l6-v2")
    parser.add_argument("--output", type=Path, default=Path("docs/reliability.md"))
    parser.add_argument("--json", type=Path, help="also write the raw figures as JSON")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to try the driver (figures mean little)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"the scenarios to run, comma-separated (default: all of {', '.join(SCENARIOS)}); the report lists those",
    )
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    if unknown := sorted(set(chosen) - set(SCENARIOS)):
        parser.error(f"unknown scenario(s) {', '.join(unknown)}: choose from {', '.join(SCENARIOS)}")
    # Before any scenario runs: a report that cannot be written, or a model that is not there, failed with a
    # traceback once the whole run (about 10 minutes) was over.
    for flag, path in (("--output", args.output), ("--json", args.json)):
        if path is not None and (why := _unwritable(path)):
            parser.error(f"{flag} {path}{why}")
    try:
        ModelRepository(args.repository).entry(args.model)
    except (RepositoryError, ServiceError) as e:
        parser.error(f"--repository {args.repository} --model {args.model}: {getattr(e, 'message', e)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # In-process servers: faults are the point here. Put back afterwards: main also runs inside a test process,
    # whose later tests read these loggers' lines.
    quiet = {name: logging.getLogger(name).level for name in ("mhaserve.service", "grpc")}
    for name in quiet:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return _run(args, chosen, argv)
    finally:
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)


def _run(args: argparse.Namespace, chosen: list[str], argv: Sequence[str] | None) -> int:
    sizes = QUICK if args.quick else Sizes()
    entry = ModelRepository(args.repository).entry(args.model)
    manifest = read_manifest(entry.directory)
    command = "python -m mhaserve.loadtest.reliability " + " ".join(argv if argv is not None else sys.argv[1:])
    run = Run(
        command=command.strip(),
        started=time.strftime("%Y-%m-%d %H:%M %Z"),
        machine=_machine_lines(),
        model=f"{manifest.name} version {manifest.version} ({manifest.layers} layers, {manifest.hidden_size} "
        f"dimensions, up to {manifest.max_seq_len} tokens)",
        sizes=sizes,
    )
    # The in-process servers hold one batch to queue the others behind it (deadlines, hangs): with one
    # inference worker, as in the short versions (tests/reliability), since a second worker computes what the
    # held batch was to hold back. The process scenarios (overload, soak, shutdown) run the defaults.
    base = Settings(
        repository=args.repository,
        model=args.model,
        port=0,
        metrics_port=0,
        http_port=0,
        device="cpu",
        intra_op_threads=2,
        inference_workers=1,
    )
    model = Model(args.model, manifest.vocab_size, manifest.max_seq_len, max_inputs=16)
    with tempfile.TemporaryDirectory(prefix="mhaserve-reliability-") as tmp:
        workdir = Path(tmp)
        scenarios: dict[str, Callable[[], None]] = {
            "bad-input": lambda: _bad_input(run, base, model, sizes, args.seed),
            "overload": lambda: _overload(run, args, sizes, workdir),
            "deadlines": lambda: _deadlines(run, base, sizes),
            "faults": lambda: _faults(run, base, args, sizes, workdir),
            "soak": lambda: _soak(run, args, sizes, workdir),
            "shutdown": lambda: _shutdown(run, args, sizes, workdir),
        }
        for name in SCENARIOS:
            if name in chosen:
                scenarios[name]()
    args.output.write_text(render(run))
    if args.json:
        args.json.write_text(json.dumps(_plain(run), indent=2, default=str) + "\n")
    failed = [c for c in run.checks if not c.passed]
    log.info("wrote %s: %d checks, %d failed", args.output, len(run.checks), len(failed))
    return 1 if failed else 0


def _unwritable(path: Path) -> str | None:
    """Why a report cannot be written at `path` (its folder is made if missing), or None."""
    if path.is_dir():
        return " is a folder: give a file's path"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f": cannot make its folder: {e.strerror or e}"
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return ": cannot be written here"
    return None


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    return value


def _flags(args: argparse.Namespace, *extra: str, metrics_port: int = 0) -> list[str]:
    return [
        *("--repository", str(args.repository), "--model", args.model, "--port", "0"),
        *("--metrics-port", str(metrics_port), "--http-port", "0", "--device", "cpu", *extra),
    ]


# ---- the scenarios, sized and judged ----------------------------------------------------------------


def _bad_input(run: Run, base: Settings, model: Model, sizes: Sizes, seed: int | None) -> None:
    with ServerThread(dataclasses.replace(base, max_client_batch_size=model.max_inputs)) as srv:
        srv.ready()
        result = _timed(run, "bad input", lambda: fuzz(srv.address, model, examples=sizes.fuzz_examples, seed=seed))
        internal = srv.counted_all("INTERNAL") + srv.counted_all("UNKNOWN")
    cases = sum(result.cases.values())
    run.check("bad input", f"{cases} cases: no failure found", not result.failures)
    codes = set().union(*(set(c) for c in result.codes.values()))
    run.check("bad input", "only OK, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED", codes <= CLIENT_CODES)
    run.check("bad input", "the server counted no INTERNAL or UNKNOWN", internal == 0)
    run.check(
        "bad input",
        "SERVING and the same good answer after every case",
        result.checks_after == cases and not result.failures,
    )


def _overload(run: Run, args: argparse.Namespace, sizes: Sizes, workdir: Path) -> None:
    queue = 64
    metrics = free_port()
    batch = str(OVERLOAD_CLIENT_BATCH)
    flags = _flags(args, "--max-queue-size", str(queue), "--max-client-batch-size", batch, metrics_port=metrics)
    with ServerProcess(flags, workdir / "overload.log") as proc:
        address = proc.wait_serving()
        requests = text_requests(address, queue_texts(200))

        def server_codes() -> dict[str, int]:
            counted = scrape(metrics)
            return {
                code: int(counted.get("mhaserve_requests_total", code=code)) for code in ("OK", "RESOURCE_EXHAUSTED")
            }

        def bursts() -> list[OverloadResult]:
            return [
                overload(
                    address,
                    requests,
                    max_queue_size=queue,
                    factor=factor,
                    burst_seconds=sizes.overload_burst,
                    measure_seconds=sizes.overload_measure,
                    clients=8,
                    server_codes=server_codes,
                )
                for factor in sizes.overload_factors
            ]

        results = _timed(run, "overload", bursts)
    for o in results:
        x = f"{o.factor:g}x:"
        run.check("overload", f"{x} every one of {o.sent} requests answered (none lost)", o.lost == 0)
        run.check("overload", f"{x} only OK or RESOURCE_EXHAUSTED", set(o.codes) <= {"OK", "RESOURCE_EXHAUSTED"})
        run.check("overload", f"{x} the excess refused with RESOURCE_EXHAUSTED", o.codes["RESOURCE_EXHAUSTED"] > 0)
        run.check("overload", f"{x} every admitted request got its own right answer", o.wrong == 0)
        run.check(
            "overload",
            f"{x} the server counted what the clients received",
            all(o.server_codes.get(c, 0) == o.client_codes[c] for c in ("OK", "RESOURCE_EXHAUSTED")),
        )
        run.check("overload", f"{x} admitted p99 latency within the queue bound", o.admitted.p99 <= o.bound)
        run.check(
            "overload",
            f"{x} refusals answered faster than admitted requests (p99 < p50)",
            o.refused.p99 < o.admitted.p50,
        )
        run.check(
            "overload",
            f"{x} throughput back to 80% of capacity within 5 s",
            o.recovery is not None and o.recovery <= 5,
        )


def _deadlines(run: Run, base: Settings, sizes: Sizes) -> None:
    engine = ScriptedEngine(hang_on=HOLD)
    with ServerThread(dataclasses.replace(base, max_wait_ms=0.0), engine.factory()) as srv:
        srv.ready()
        try:
            result = _timed(
                run,
                "deadlines",
                lambda: deadlines(srv, engine, cycles=sizes.deadline_cycles, per_cycle=50, streams=8),
            )
        finally:
            engine.release.set()
    before, after = result.before, result.after
    run.check(
        "deadlines",
        f"{result.expired_sent} expired while queued: all DEADLINE_EXCEEDED and counted",
        result.expired_codes == {"DEADLINE_EXCEEDED": result.expired_sent}
        and result.server_deadline_exceeded == result.expired_sent,
    )
    run.check(
        "deadlines",
        f"{result.cancelled_sent} cancelled while queued and {result.streams_cancelled} streams cancelled: all counted",
        result.cancelled_codes == {"CANCELLED": result.cancelled_sent}
        and result.server_cancelled == result.cancelled_sent + result.streams_cancelled,
    )
    run.check("deadlines", "none of them reached the model", result.reached_model == 0)
    run.check(
        "deadlines",
        "nothing left behind: tasks, jobs, sequences, RPCs in flight, queue",
        after is not None
        and before is not None
        and (after.jobs, after.seqs, after.in_flight, after.depth) == (0, 0, 0, 0)
        and after.tasks <= before.tasks,
    )


def _faults(run: Run, base: Settings, args: argparse.Namespace, sizes: Sizes, workdir: Path) -> None:
    engine = ScriptedEngine(fail_on=POISON, seconds_per_batch=0.002)
    # A queue that holds every request at once: this scenario is about faults, not refusals (overload's). At
    # least the default, which holds a request of the most inputs a request may hold by default (a smaller queue
    # is refused at start-up).
    queue = max(base.max_queue_size or CPU_LIMITS.max_queue_size, sizes.fault_requests)
    roomy = dataclasses.replace(base, max_wait_ms=2.0, max_queue_size=queue)
    with ServerThread(roomy, engine.factory()) as srv:
        srv.ready()
        faults = _timed(run, "engine errors", lambda: engine_faults(srv, engine, requests=sizes.fault_requests))
    run.check(
        "faults",
        f"{faults.poisoned} poisoned requests: all INTERNAL",
        faults.poisoned_codes == {"INTERNAL": faults.poisoned},
    )
    run.check(
        "faults",
        f"no other request failed, {faults.shared_with_poison} of them in a batch with poison",
        faults.failed_without_poison == 0 and faults.shared_with_poison > 0,
    )
    run.check("faults", "every other answer right; SERVING after", faults.wrong == 0 and faults.serving_after)

    hang_engine = ScriptedEngine(hang_on=HOLD)
    settings = dataclasses.replace(base, inference_timeout=0.5, max_wait_ms=0.0)
    with ServerThread(settings, hang_engine.factory()) as srv:
        srv.ready()
        try:
            hangs = _timed(run, "engine hangs", lambda: engine_hangs(srv, hang_engine, cycles=sizes.hang_cycles))
        finally:
            hang_engine.release.set()
    n = hangs.hangs
    run.check(
        "faults",
        f"{n} hangs past --inference-timeout: the stuck and queued requests UNAVAILABLE",
        hangs.hung_codes == {"UNAVAILABLE": n} and set(hangs.queued_codes) == {"UNAVAILABLE"},
    )
    run.check(
        "faults",
        "health NOT_SERVING (and answering) while stuck, new requests refused",
        hangs.health_while_stuck["NOT_SERVING"] == n and hangs.refused_codes == {"UNAVAILABLE": n},
    )
    run.check("faults", "SERVING again when the engine returned", hangs.recovered == n)

    proc = ServerProcess(
        _flags(args, "--inference-timeout", "1", "--grace-period", "5"), workdir / "stuck.log", engine="hang:99"
    )
    with proc:
        stuck = _timed(run, "stuck engine exit", lambda: stuck_engine_exit(proc))
    run.check("faults", "a process with a stuck engine exits on SIGTERM (status 1)", stuck.exit_code == 1)


def _soak(run: Run, args: argparse.Namespace, sizes: Sizes, workdir: Path) -> None:
    with ServerProcess(_flags(args, "--max-wait-ms", "2"), workdir / "soak.log") as proc:
        address = proc.wait_serving()
        requests = text_requests(address, queue_texts(200, seed=1))
        result = _timed(
            run,
            "soak",
            lambda: soak(
                proc,
                requests,
                seconds=sizes.soak_seconds,
                clients=4,
                interval=2.0 if sizes.soak_seconds > 60 else 0.5,
                bound_kib_per_min=SOAK_BOUND_KIB_PER_MIN,
            ),
        )
    steady = result.steady()
    run.check("soak", f"{result.requests} requests, all OK", set(result.codes) == {"OK"})
    run.check(
        "soak",
        f"resident memory slope after warm-up <= {SOAK_BOUND_KIB_PER_MIN:g} KiB/min",
        result.rss_slope_kib_per_min <= SOAK_BOUND_KIB_PER_MIN,
    )
    run.check("soak", "open descriptors do not grow", max(s.fds for s in steady) <= steady[0].fds + 4)
    run.check("soak", "threads do not grow", max(s.threads for s in steady) <= steady[0].threads + 2)


def _shutdown(run: Run, args: argparse.Namespace, sizes: Sizes, workdir: Path) -> None:
    flags = _flags(args, "--max-wait-ms", "5", "--grace-period", "30", "--log-level", "debug")
    with ServerProcess(flags, workdir / "shutdown.log") as proc:
        address = proc.wait_serving()
        requests = text_requests(address, queue_texts(100, seed=2))
        result = _timed(
            run, "shutdown", lambda: shutdown_under_load(proc, requests, clients=8, load_seconds=sizes.shutdown_load)
        )
    run.check("shutdown", "exit status 0 after SIGTERM under load", result.exit_code == 0)
    run.check(
        "shutdown",
        f"the {result.in_flight_at_signal} requests in flight at the signal: answered OK, or refused at the door",
        result.in_flight_ok > 0 and result.in_flight_ok + result.in_flight_refused == result.in_flight_at_signal,
    )
    run.check(
        "shutdown",
        "no accepted request lost: the server's OK count equals the clients', no CANCELLED sent before the signal",
        result.server_ok == result.codes["OK"]
        and result.cancelled_sent_before_signal == 0
        and result.server_cancelled == 0,
    )
    forced = []
    for sig in (15, 2):
        metrics = free_port()
        flags = _flags(args, "--grace-period", "120", "--inference-timeout", "0", metrics_port=metrics)
        with ServerProcess(flags, workdir / f"second-{sig}.log", engine="hang:99") as proc:
            forced.append(second_signal(proc, metrics, sig=sig))
    run.results["second signal"] = forced
    for f, code in zip(forced, (143, 130), strict=True):
        run.check(
            "shutdown", f"{f.signals}: exits at once with {code}", f.after_first_still_running and f.exit_code == code
        )
