"""The options of `mhaserve bench`: argparse only, so building the CLI parser imports nothing heavy."""

from __future__ import annotations

import argparse
import math
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from mhaserve.runtime import manifest as mf
from mhaserve.runtime.cpus import available_cpus
from mhaserve.runtime.repository import GRAPHS
from mhaserve.service.settings import Settings, auto_inference_workers, env_var, on_cpu, worker_threads

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
WORKLOADS = ("fixed", "mixed", "short")
BATCHING = ("arrival", "length")
# gRPC (encoder.v1 Encode) for every policy; the HTTP ones (OpenAI POST /v1/embeddings, `encoding_format`
# float or base64) beside it on the text workloads, for one policy; and for one client, a synchronous stub
# (not by default: on the 2-core VM it read as grpc.aio's client, docs/benchmarks.md's twelfth session).
GRPC_SYNC = "grpc-sync"
PROTOCOLS = ("grpc", GRPC_SYNC, "http", "http-base64")
DEFAULT_PROTOCOLS = ("grpc", "http")

# --quick: a tiny random model, two client counts, a second per point: the whole pipeline in seconds.
QUICK: dict[str, Any] = {
    "concurrency": (1, 4),
    "batch_sizes": (1, 8),
    "duration": 1.0,
    "min_time": 0.3,
    "fixed_tokens": 32,
    "fixed_pool": 16,
    "mixed_pool": 32,
    "short_pool": 48,
    "torch_batch_size": 8,
    "retries": 0,
    "paired": 1,
    "rss_requests": 1000,
    "beside_bulk": (0, 1),
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


N = TypeVar("N", int, float)


def _bounded(cast: Callable[[str], N], low: N, *, above: bool, what: str) -> Callable[[str], N]:
    """An argparse type: a number (int or float) at least `low`, or above it, and finite."""

    def parse(text: str) -> N:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_seconds = _bounded(float, 0.0, above=True, what="a number of seconds above 0")
_count = _bounded(int, 0, above=False, what="a whole number >= 0")
_positive = _bounded(int, 1, above=False, what="a whole number >= 1")
_at_least_zero = _bounded(float, 0.0, above=False, what="a number >= 0")
_rate = _bounded(float, 0.0, above=True, what="a number above 0")


def _names(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if len(values) < 2 or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected two or more different model names, comma-separated, got {text!r}")
    return values


def _choices(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)}, got {text!r}")
        return values

    return parse


def _bulk_clients(text: str) -> tuple[int, ...]:
    """--beside-bulk: counts of bulk clients (0: the queries alone), or none."""
    if text.strip().lower() == "none":
        return ()
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 0 or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected different whole numbers >= 0, or none; got {text!r}")
    return values


def _protocols(text: str) -> tuple[str, ...]:
    values = _choices(PROTOCOLS)(text)
    if "grpc" not in values:
        raise argparse.ArgumentTypeError("grpc is always measured (the policies and HTTP are compared over it): add it")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `mhaserve bench`; None means "the default, or --quick's"."""
    p.add_argument(
        "--repository",
        help="model repository (default: env MHASERVE_REPOSITORY as for mhaserve serve, else models; with --quick, "
        "a fresh tiny random model)",
    )
    p.add_argument("--model", help="model name (default: the server's default model)")
    # Two different runs: argparse refuses both together (exit 2) as it does any other bad option.
    runs = p.add_mutually_exclusive_group()
    runs.add_argument(
        "--models",
        type=_names,
        metavar="A,B",
        help="instead of the sweep: one server serving these models (two or more), each model's clients alone and "
        "then all at once, at each client count and workload; with --quick and no --repository, tiny random models "
        "of these names and of different widths",
    )
    p.add_argument(
        "--graph",
        default="auto",
        choices=GRAPHS,
        help="the graph the sweep serves and runs in-process, passed to `mhaserve serve --graph` (default auto)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="where the model runs")
    p.add_argument(
        "--threads",
        type=_positive,
        help="ONNX Runtime (and PyTorch) intra-op threads (default: the server's, all cores)",
    )
    p.add_argument(
        "--concurrency", type=_ints, help=f"client counts to sweep (default {','.join(map(str, DEFAULT_CONCURRENCY))})"
    )
    p.add_argument(
        "--batch-sizes",
        type=_ints,
        help=f"in-process batch sizes to sweep for the ceiling (default {','.join(map(str, DEFAULT_BATCH_SIZES))})",
    )
    p.add_argument("--duration", type=_seconds, help="measured seconds per server point (default 8)")
    p.add_argument("--min-time", type=_seconds, help="least seconds per in-process measurement (default 3)")
    p.add_argument("--fixed-tokens", type=_positive, help="tokens per input of the fixed workload (default 128)")
    p.add_argument("--fixed-pool", type=_positive, help="distinct inputs of the fixed workload (default 64)")
    p.add_argument(
        "--mixed-pool", type=_positive, help="inputs of the mixed workload, drawn from the corpus (default 256)"
    )
    p.add_argument(
        "--short-pool",
        type=_positive,
        help="inputs of the short workload: the short-text corpus's 2,000 texts, each once, by default",
    )
    p.add_argument(
        "--torch-batch-size", type=_positive, help="PyTorch eager batch size (default 32, sentence-transformers')"
    )
    p.add_argument(
        "--workloads", type=_choices(WORKLOADS), default=WORKLOADS, help=f"some of {', '.join(WORKLOADS)} (default all)"
    )
    p.add_argument(
        "--batching",
        type=_choices(BATCHING),
        default=BATCHING,
        help=f"server batching policies to run: some of {', '.join(BATCHING)} (default all)",
    )
    p.add_argument(
        "--protocols",
        type=_protocols,
        default=DEFAULT_PROTOCOLS,
        help="grpc (always: every policy is measured over it, from grpc.aio), and beside it on the length policy's "
        "server: http (POST /v1/embeddings, float vectors) and http-base64 (encoding_format base64) on the text "
        f"workloads, and {GRPC_SYNC} (grpcio's synchronous stub, as `mhaserve encode` calls) at 1 client only "
        f"(default {','.join(DEFAULT_PROTOCOLS)})",
    )
    p.add_argument(
        "--grpc-client",
        choices=("aio", "h2"),
        default="aio",
        help="the gRPC load generator: grpc.aio's client (aio, the default), or the bench's own HTTP/2 client "
        "(h2), which costs the load generator as little a request as its HTTP client does (default aio)",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager baseline")
    p.add_argument(
        "--paired",
        type=_count,
        help="rounds measuring the ceiling and the server at 32 clients in turns (default 3): on the fixed workload "
        "over gRPC; on the short workload the server's own batches in process, gRPC and HTTP too; and, when the "
        "sweep has 1 client, on the short workload ONNX Runtime one text at a time and one client of each protocol "
        "in turns; 0 skips them",
    )
    p.add_argument(
        "--beside-bulk",
        type=_bulk_clients,
        metavar="N,M",
        help="queries beside indexing clients, on the short workload over HTTP (beside.py): queries at random times "
        "(--query-rate) for --duration beside each of these counts of bulk clients sending 64 texts a request (0: the "
        "queries alone, also replayed in process), in --paired rounds (at least one); none skips it (default 0,1,2; "
        "with --quick 0,1)",
    )
    p.add_argument(
        "--query-rate", type=_rate, default=10.0, metavar="Q", help="queries a second for --beside-bulk (default 10)"
    )
    p.add_argument(
        "--rss-requests",
        type=_count,
        metavar="N",
        help="server memory: serve each graph of --graphs from a fresh server and read its resident and peak memory "
        "after warm-up and after N requests; 0 skips it (default 20000: minutes a graph for all-MiniLM-L6-v2 on 2 "
        "cores; issue 18 asks for 100000)",
    )
    p.add_argument(
        "--graphs",
        type=_choices(mf.GRAPH_NAMES),
        metavar="G,H",
        help="the graphs whose server memory is measured, each served in turn (`mhaserve serve --graph G`): some of "
        f"{', '.join(mf.GRAPH_NAMES)} (default: the CPU graphs the entry has, fp32, optimized, optimized-cpu and "
        "int8); one the entry lacks, or this server cannot serve, is skipped with a note in the report",
    )
    runs.add_argument(
        "--memory-only",
        action="store_true",
        help="instead of the sweep: only the server memory (--graphs, --rss-requests); writes its own report",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra flag for `mhaserve serve`, e.g. --server-arg=--max-wait-ms=5 (repeatable)",
    )
    g = p.add_argument_group("on a shared machine")
    g.add_argument(
        "--max-other-cpu",
        type=_at_least_zero,
        default=0.1,
        metavar="CORES",
        help="a measurement during which other processes took more CPU than this is taken again (default 0.1)",
    )
    g.add_argument("--retries", type=_count, help="how many times to measure a disturbed figure again (default 2)")
    g.add_argument(
        "--quiet-wait",
        type=_at_least_zero,
        default=30.0,
        metavar="S",
        help="longest wait for the machine to calm down before a measurement (default 30)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads' draws")
    p.add_argument(
        "--quick", action="store_true", help="a tiny random model and few short points: seconds, not minutes"
    )
    p.add_argument("--output", help="results directory (default: results/bench-<timestamp>)")


FULL: dict[str, Any] = {
    "concurrency": DEFAULT_CONCURRENCY,
    "batch_sizes": DEFAULT_BATCH_SIZES,
    "duration": 8.0,
    "min_time": 3.0,
    "fixed_tokens": 128,
    "fixed_pool": 64,
    "mixed_pool": 256,
    "short_pool": 2000,
    "torch_batch_size": 32,
    "retries": 2,
    "paired": 3,
    "rss_requests": 20_000,
    "beside_bulk": (0, 1, 2),
}


def resolve(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options in force: those given, then --quick's or the full run's defaults. The repository, unless
    given or --quick's scratch one, is MHASERVE_REPOSITORY's as for `mhaserve serve` (the bench measured
    ./models while the server under the same environment served another folder), else models/."""
    env = os.environ if env is None else env
    base = QUICK if args.quick else FULL
    out = dict(vars(args))
    out.pop("handler", None)
    if out.get("repository") is None and not args.quick:
        out["repository"] = env.get(env_var("repository")) or None
    for key, default in base.items():
        if out.get(key) is None:
            out[key] = default
    return out


def unmeasured(args: argparse.Namespace) -> str | None:
    """Why a protocol given in --protocols, or the queries beside bulk clients, would not be measured by the run
    these options make, or None: the run once skipped such an option without a word."""
    beside_bulk = getattr(args, "beside_bulk", None)
    if args.models or args.memory_only:
        run = "--models" if args.models else "--memory-only"
        return f"--beside-bulk: measured by the sweep, not by a {run} run" if beside_bulk else None
    opt = resolve(args)
    if beside_bulk and "short" not in opt["workloads"]:
        return (
            f"--beside-bulk {','.join(map(str, args.beside_bulk))}: the queries and the bulk clients send the short "
            f"workload's texts, and --workloads {','.join(opt['workloads'])} has none"
        )
    if args.protocols is None:
        return None
    http = [p for p in opt["protocols"] if p.startswith("http")]
    if http and not [w for w in opt["workloads"] if w != "fixed"]:
        return (
            f"--protocols {','.join(http)}: HTTP is measured on the workloads sent as text (mixed, short), "
            f"and --workloads {','.join(opt['workloads'])} has none"
        )
    if GRPC_SYNC in opt["protocols"] and 1 not in opt["concurrency"]:
        return f"--protocols {GRPC_SYNC}: the synchronous stub is measured at 1 client: add 1 to --concurrency"
    return None


def command_line(args: argparse.Namespace) -> str:
    """The `mhaserve bench` command that reproduces a run (the options that were given)."""
    parts = ["mhaserve", "bench"]
    defaults = {
        "graph": "auto",
        "device": "auto",
        "workloads": WORKLOADS,
        "batching": BATCHING,
        "protocols": DEFAULT_PROTOCOLS,
        "grpc_client": "aio",
        "seed": 0,
        "max_other_cpu": 0.1,
        "quiet_wait": 30.0,
        "query_rate": 10.0,
    }
    for key, value in vars(args).items():
        # Identity for None and False: `0 in (False,)` is true, and --retries 0 must be kept.
        if key in ("handler", "command", "verbose", "output") or value is None or value is False or value == []:
            continue
        if key in defaults and value == defaults[key]:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, tuple):
            parts += [flag, ",".join(map(str, value)) or "none"]
        elif isinstance(value, list):
            parts += [f"{flag}={v}" for v in value]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def server_flags(server_args: Sequence[str]) -> dict[str, str]:
    """The flags with a value passed to the server through --server-arg, by flag: `--flag=value`, or `--flag`
    and `value` as two (`--server-arg=--grpc-front --server-arg=grpc`, which the server reads alike)."""
    flags: dict[str, str] = {}
    for i, arg in enumerate(server_args):
        if not arg.startswith("--"):
            continue
        if "=" in arg:
            flag, value = arg.split("=", 1)
            flags[flag] = value
        elif i + 1 < len(server_args) and not server_args[i + 1].startswith("-"):
            flags[arg] = server_args[i + 1]
    return flags


def server_processes(server_args: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """How many server processes `mhaserve serve` runs (`--processes`, through --server-arg or the
    environment the server inherits); 1 unless told."""
    env = os.environ if env is None else env
    value = server_flags(server_args).get("--processes", env.get("MHASERVE_PROCESSES", "")).strip()
    try:
        return int(value) if value else 1
    except ValueError:
        raise ValueError(f"the server's --processes {value!r} is not a number") from None


# `mhaserve serve --grpc-front`: its default and its choices, read from the setting itself.
_FRONT = Settings.__dataclass_fields__["grpc_front"]
FRONTS: tuple[str, ...] = _FRONT.metadata["choices"]


def server_front(server_args: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """What serves the server's gRPC port (`--grpc-front`, through --server-arg or the environment the server
    inherits; the server's default unless told): the empty server of the paired one-client rounds runs the
    same, so that its floor is the served front's."""
    env = os.environ if env is None else env
    value = server_flags(server_args).get("--grpc-front", env.get(env_var("grpc_front"), _FRONT.default))
    front: str = _FRONT.metadata["parse"](value)  # as the server reads it (its case folded)
    if front not in FRONTS:
        raise ValueError(f"the server's --grpc-front {value!r} is not one of {', '.join(FRONTS)}")
    return front


def served_batching(
    concurrency: Sequence[int], server_args: Sequence[str], headline: int, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """What the in-process replay of the server's batches needs: the client count nearest the headline's, and
    the padding cap and token budget passed to the server (flags, else its environment; None: its defaults)."""
    env = os.environ if env is None else env
    flags = server_flags(server_args)
    padding = flags.get("--max-padding", env.get("MHASERVE_MAX_PADDING"))
    budget = flags.get("--max-batch-tokens", env.get("MHASERVE_MAX_BATCH_TOKENS"))
    try:
        return {
            "clients": min(concurrency, key=lambda c: abs(c - headline)),
            "max_padding": None if padding is None else float(padding),
            "max_batch_tokens": None if budget is None else int(budget),
        }
    except ValueError:
        # The server would refuse them too; say so before the in-process measurements, not after.
        raise ValueError(
            f"the server's max padding {padding!r} or max batch tokens {budget!r} is not a number"
        ) from None


def _server_workers(server_args: Sequence[str], env: Mapping[str, str], device: str) -> str:
    """The served model's inference workers as the server will have them: its --inference-workers flag passed
    through --server-arg, else its environment, else its own choice for the device and its share of the cores."""
    workers = server_flags(server_args).get("--inference-workers", env.get("MHASERVE_INFERENCE_WORKERS", "auto"))
    if workers.strip().lower() in ("", "none", "auto"):
        processes = server_processes(server_args, env)
        return str(auto_inference_workers(device, max(1, available_cpus() // processes)))
    return workers


def _fixed_threads(threads: int | None, server_args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The intra-op threads a batch gets when they are fixed (the bench's --threads, the server's flag or
    environment); None: the server sizes them by its cores."""
    fixed = threads or server_flags(server_args).get("--intra-op-threads") or env.get("MHASERVE_INTRA_OP_THREADS")
    return str(fixed) if fixed else None


def side_by_side(
    threads: int | None,
    server_args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    device: str = "auto",
) -> dict[str, int] | None:
    """How the in-process reference of batches computed side by side is laid out, when the server computes
    several at once on a CPU with the cores split between its workers (one process, threads not fixed):
    `workers` callers of one engine whose batch beside another runs on `overlap_threads` (the server's
    split: service/server.py). None otherwise: one worker, fixed threads, several processes, or a GPU."""
    env = os.environ if env is None else env
    if not on_cpu(device) or _fixed_threads(threads, server_args, env) or server_processes(server_args, env) != 1:
        return None
    try:
        workers = int(_server_workers(server_args, env, device))
    except ValueError:
        return None  # the server refuses it too, and says so
    if workers < 2:
        return None
    return {"workers": workers, "overlap_threads": worker_threads(available_cpus(), workers)}


def server_threads(
    threads: int | None,
    server_args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    device: str = "auto",
) -> str:
    """How the served model's threads were set, for the report: the bench's --threads, else the server's own
    flags passed through --server-arg, else its environment (which the server inherits from the bench), else
    the server's own choice for the device and its cores (`--inference-workers auto`). Decided when the run
    starts, with the environment the server gets, and recorded in report.json."""
    env = os.environ if env is None else env
    workers = _server_workers(server_args, env, device)
    processes = server_processes(server_args, env)
    per_batch = _fixed_threads(threads, server_args, env)
    split = "" if workers == "1" else f", {workers} inference workers"
    if per_batch:
        words = f"{per_batch} per batch{split}"
    elif split:
        words = f"the cores split between {workers} inference workers (server default)"
    else:
        words = "all cores (server default)"
    if processes == 1:
        return words
    # As the supervisor decides (service/processes.py): pinned to a share on a GPU or with fixed threads.
    shared = on_cpu(device) and not per_batch
    how = "sharing the cores: a batch alone on all of them" if shared else "each pinned to its share of the cores"
    return f"{words}, in each of {processes} server processes ({how})"
