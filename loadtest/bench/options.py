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
from mhaserve.service.settings import (
    Settings,
    SettingsError,
    auto_inference_workers,
    env_var,
    flag,
    on_cpu,
    worker_threads,
)

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
WORKLOADS = ("fixed", "mixed", "short")
BATCHING = ("arrival", "length")
# gRPC (encoder.v1 Encode) for every policy; the HTTP ones (OpenAI POST /v1/embeddings, `encoding_format`
# float or base64) beside it on the text workloads, for one policy; and for one client, a synchronous stub
# (not by default: on the 2-core VM it read as grpc.aio's client, docs/benchmarks.md's twelfth session).
GRPC_SYNC = "grpc-sync"
PROTOCOLS = ("grpc", GRPC_SYNC, "http", "http-base64")
DEFAULT_PROTOCOLS = ("grpc", "http")  # HTTP where a workload is sent as text (text_workloads)

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


def text_workloads(workloads: Sequence[str]) -> list[str]:
    """The workloads sent as text, which HTTP is measured on: the OpenAI route is for text, and the fixed
    workload is token ids."""
    return [w for w in workloads if w != "fixed"]


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
    p.add_argument("--workloads", type=_choices(WORKLOADS), help=f"some of {', '.join(WORKLOADS)} (default all)")
    p.add_argument(
        "--batching",
        type=_choices(BATCHING),
        help=f"server batching policies to run: some of {', '.join(BATCHING)} (default all)",
    )
    p.add_argument(
        "--protocols",
        type=_protocols,
        help="grpc (always: every policy is measured over it, from grpc.aio), and beside it on the length policy's "
        "server: http (POST /v1/embeddings, float vectors) and http-base64 (encoding_format base64) on the text "
        f"workloads, and {GRPC_SYNC} (grpcio's synchronous stub, as `mhaserve encode` calls) at 1 client only "
        f"(default {','.join(DEFAULT_PROTOCOLS)}, http only where a workload is sent as text)",
    )
    p.add_argument(
        "--grpc-client",
        choices=("aio", "h2"),
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
    p.add_argument("--query-rate", type=_rate, metavar="Q", help="queries a second for --beside-bulk (default 10)")
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
        metavar="CORES",
        help="a measurement during which other processes took more CPU than this is taken again (default 0.1)",
    )
    g.add_argument("--retries", type=_count, help="how many times to measure a disturbed figure again (default 2)")
    g.add_argument(
        "--quiet-wait",
        type=_at_least_zero,
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


# The defaults of both kinds of run. The parser leaves these None too, so that an option given can be told
# from its default (unread, unmeasured).
COMMON: dict[str, Any] = {
    "workloads": WORKLOADS,
    "batching": BATCHING,
    "grpc_client": "aio",
    "query_rate": 10.0,
    "max_other_cpu": 0.1,
    "quiet_wait": 30.0,
}


def resolve(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options in force: those given, then --quick's or the full run's defaults. The repository, unless
    given or --quick's scratch one, is MHASERVE_REPOSITORY's as for `mhaserve serve` (the bench measured
    ./models while the server under the same environment served another folder), else models/."""
    env = os.environ if env is None else env
    base = COMMON | (QUICK if args.quick else FULL)
    out = dict(vars(args))
    out.pop("handler", None)
    if out.get("repository") is None and not args.quick:
        out["repository"] = env.get(env_var("repository")) or None
    for key, default in base.items():
        if out.get(key) is None:
            out[key] = default
    if out.get("protocols") is None:
        # The default measures what it can: HTTP only beside workloads sent as text (`--workloads fixed`, README's
        # example, was refused for an HTTP nobody had asked for).
        http = bool(text_workloads(out["workloads"]))
        out["protocols"] = tuple(p for p in DEFAULT_PROTOCOLS if http or not p.startswith("http"))
    return out


def refused(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str | None:
    """Why these options make no run, said before anything is measured (a usage error), or None: each of these
    was once found minutes into a run, in a traceback, or not at all."""
    return (
        unread(args)
        or unmeasured(args)
        or _quick_graph(args)
        or _quick_model(args)
        or server_refused(resolve(args, env), env)
    )


# The options only the sweep reads; given to one of the other runs, each was ignored without a word while the
# report's command echoed it. (--no-torch is not among them: it skips what those runs never measure.)
SWEEP_ONLY = (
    "batch_sizes",
    "min_time",
    "torch_batch_size",
    "protocols",
    "grpc_client",
    "paired",
    "beside_bulk",
    "query_rate",
)
# What else each other run leaves unread, and what it measures instead.
OTHER_RUNS: dict[str, tuple[tuple[str, ...], str]] = {
    "models": (
        ("model", "rss_requests", "graphs"),
        "serves the models it names from one server with one batching policy, each over gRPC from grpc.aio's client",
    ),
    "memory_only": (
        ("concurrency", "duration", "max_other_cpu", "retries", "quiet_wait"),
        "serves each of --graphs in turn, with one batching policy, to 32 clients of one workload over gRPC from "
        "grpc.aio's client, and measures its memory, not its time",
    ),
}


def unread(args: argparse.Namespace) -> str | None:
    """The options given that a --models or --memory-only run does not read, named, or None."""
    run = "models" if args.models else "memory_only" if args.memory_only else None
    if run is None:
        return None
    if run == "memory_only" and args.rss_requests == 0:
        return "--rss-requests 0: a --memory-only run would measure nothing"
    also, what = OTHER_RUNS[run]
    given = [flag(name) for name in (*SWEEP_ONLY, *also) if getattr(args, name) is not None]
    # Both serve one policy, and the memory run sends one workload: the others given were dropped.
    if args.batching is not None and len(args.batching) > 1:
        given.append(f"--batching {','.join(args.batching)}")
    if run == "memory_only" and args.workloads is not None and len(args.workloads) > 1:
        given.append(f"--workloads {','.join(args.workloads)}")
    return f"{', '.join(given)}: not read by a {flag(run)} run, which {what}" if given else None


def unmeasured(args: argparse.Namespace) -> str | None:
    """Why a protocol given in --protocols, the queries beside bulk clients, their --query-rate or the --graphs
    whose memory is measured would not be measured by the sweep these options make, or None: the run once
    skipped such an option without a word."""
    if args.models or args.memory_only:
        return None  # unread() names the sweep's options given to these
    opt = resolve(args)
    # Where an option goes unread for another one, each names what to do instead: give what makes the run read
    # it, or leave it out.
    if args.beside_bulk and "short" not in opt["workloads"]:
        return (
            f"--beside-bulk {','.join(map(str, args.beside_bulk))}: the queries and the bulk clients send the short "
            f"workload's texts, and --workloads {','.join(opt['workloads'])} has none: add short to --workloads, or "
            "give --beside-bulk none"
        )
    if args.torch_batch_size is not None and args.no_torch:
        return (
            f"--torch-batch-size {args.torch_batch_size}: the PyTorch eager baseline is measured in batches of that "
            "size, and --no-torch skips it: leave out one of them"
        )
    if args.graphs is not None and not opt["rss_requests"]:
        return (
            f"--graphs {','.join(args.graphs)}: the sweep measures the server's memory of each graph after "
            "--rss-requests requests, and --rss-requests 0 skips it: give --rss-requests above 0, or leave --graphs out"
        )
    if args.query_rate is not None and not opt["beside_bulk"]:
        return (
            f"--query-rate {args.query_rate:g}: the queries beside bulk clients are sent by the --beside-bulk step, "
            "and --beside-bulk none skips it: give --beside-bulk counts of bulk clients (0: the queries alone), or "
            "leave --query-rate out"
        )
    if args.query_rate is not None and "short" not in opt["workloads"]:
        return (
            f"--query-rate {args.query_rate:g}: the queries beside bulk clients send the short workload's texts, and "
            f"--workloads {','.join(opt['workloads'])} has none: add short to --workloads, or leave --query-rate out"
        )
    if args.protocols is None:
        return None  # the default measures what it can (resolve)
    http = [p for p in opt["protocols"] if p.startswith("http")]
    if http and not text_workloads(opt["workloads"]):
        # Only the fixed workload is left, whose ids the OpenAI route cannot take: say both ways out.
        texts = text_workloads(WORKLOADS)
        return (
            f"--protocols {','.join(http)}: HTTP is measured on the workloads sent as text ({', '.join(texts)}), "
            f"and --workloads {','.join(opt['workloads'])} has none (its token ids are sent over gRPC alone): add "
            f"{' or '.join(texts)} to --workloads, or leave {','.join(http)} out of --protocols"
        )
    if GRPC_SYNC in opt["protocols"] and 1 not in opt["concurrency"]:
        return f"--protocols {GRPC_SYNC}: the synchronous stub is measured at 1 client: add 1 to --concurrency"
    return None


def _quick_graph(args: argparse.Namespace) -> str | None:
    """Why --quick's own tiny model cannot be served with --graph, or with any graph --graphs names, or None: it
    was made, and refused seconds later."""
    if not args.quick or args.repository:
        return None
    from mhaserve.loadtest.bench.entries import quick_graphs

    # --models' tiny models are made without the fused graphs (models.py), the sweep's and the memory run's with.
    have = quick_graphs(optimize=not args.models)
    if args.graph != "auto" and args.graph not in have:
        flag = f"--graph {args.graph}"
    elif args.graphs and not set(args.graphs) & set(have):  # (one of several lacking is skipped with a note)
        flag = f"--graphs {','.join(args.graphs)}"
    else:
        return None
    model = "tiny models have" if args.models else "tiny model has"
    return (
        f"{flag}: --quick's {model} the {', '.join(have)} graph{'s' if len(have) > 1 else ''} only: "
        "give --repository with a model that has it"
    )


def _quick_model(args: argparse.Namespace) -> str | None:
    """Why --model names nothing --quick benches, or None: without --repository --quick makes and benches its own
    tiny model (entries.chosen_entry), and the model named was ignored while the report's command echoed it.
    (--models' runs refuse --model already: unread.)"""
    if not args.quick or args.repository or args.model is None or args.models:
        return None
    from mhaserve.loadtest.bench.entries import QUICK_MODEL

    return (
        f"--model {args.model}: --quick without --repository benches a tiny random model of its own ({QUICK_MODEL}): "
        "give --repository with that model, or leave --model out"
    )


def server_settings(server_args: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[Settings, set[str]]:
    """The settings the bench's servers start with, read as `mhaserve serve` reads them (cli/options.py): the flags
    passed through --server-arg, then the environment they inherit, then the defaults; and the settings given
    as flags. SettingsError for one the server would refuse, named as it was set."""
    from mhaserve.cli.options import add_arguments, build

    parser = argparse.ArgumentParser(prog="mhaserve bench --server-arg", add_help=False)
    add_arguments(parser)
    namespace, _ = parser.parse_known_args(list(server_args))  # unknown flags: refused by the CLI already
    flags = {name for name, value in vars(namespace).items() if value is not None}
    return build(namespace, env), flags


# The settings the bench's clients cannot reach a server through, and why: they send no API key (admin keys
# alone turn authentication on too), and speak plaintext gRPC and HTTP. Refused rather than dropped from the
# server's environment: the server runs as the user set it, or not at all.
CLIENTS_CANNOT = {
    ("api_keys", "api_keys_file", "admin_keys", "admin_keys_file"): (
        "the bench's clients send no API key, so its server would refuse every call"
    ),
    ("tls_cert", "tls_key", "tls_client_ca"): (
        "the bench's clients speak plaintext gRPC and HTTP, which its server would not answer"
    ),
}


def server_refused(opt: dict[str, Any], env: Mapping[str, str] | None = None) -> str | None:
    """Why the bench's servers cannot run as its --server-arg flags and the environment they inherit say, or
    None: read now, once, as the server will read them, where a bad one ended the run minutes in, in a traceback
    (the grpc front read by the paired rounds after the whole sweep, API keys at the first call)."""
    env = os.environ if env is None else env
    # The bench names its servers' model with --model (client.Server), which wins over MHASERVE_MODEL: what that
    # holds never reaches them
    env = {k: v for k, v in env.items() if k != env_var("model")}
    try:
        settings, flags = server_settings(opt["server_arg"], env)
        # What the bench reads of them itself, later in the run, read now too.
        server_front(opt["server_arg"], env)
        server_processes(opt["server_arg"], env)
    except SettingsError as e:
        return f"the bench's server: {e}"
    except ValueError as e:  # the bench's own readers name the server
        return str(e)
    fields = Settings.__dataclass_fields__
    for names, why in CLIENTS_CANNOT.items():
        named = [
            f"--server-arg={flag(name)}" if name in flags else env_var(name)
            for name in names
            if getattr(settings, name) != fields[name].default
        ]
        if named:
            return f"{', '.join(named)}: {why}: run the bench without {'it' if len(named) == 1 else 'them'}"
    return _bulk_refused(opt, settings)


def _bulk_refused(opt: dict[str, Any], settings: Settings) -> str | None:
    """Why the bulk clients of --beside-bulk would be refused by the server, or None: every bulk request failed,
    and the queries ran alone whatever the report said."""
    from mhaserve.loadtest.bench.beside import BULK_INPUTS

    limit = settings.max_client_batch_size
    bulk = any(opt["beside_bulk"]) and "short" in opt["workloads"] and not (opt["models"] or opt["memory_only"])
    if not bulk or limit is None or limit >= BULK_INPUTS:
        return None
    return (
        f"--beside-bulk {','.join(map(str, opt['beside_bulk']))}: the bulk clients send {BULK_INPUTS} texts a "
        f"request, and the server's --max-client-batch-size {limit} refuses them: give --beside-bulk 0 (the queries "
        "alone) or none"
    )


def command_line(args: argparse.Namespace) -> str:
    """The `mhaserve bench` command that reproduces a run (the options that were given)."""
    parts = ["mhaserve", "bench"]
    defaults = {
        "graph": "auto",
        "device": "auto",
        "seed": 0,
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
    given = server_flags(server_args)
    # Named as it was set: a value from the environment was once reported as a flag nobody had typed. An empty
    # variable is unset, as serve reads it.
    named = "--grpc-front" if "--grpc-front" in given else env_var("grpc_front")
    value = given.get("--grpc-front", env.get(env_var("grpc_front")) or _FRONT.default)
    front: str = _FRONT.metadata["parse"](value)  # as the server reads it (its case folded)
    if front not in FRONTS:
        raise ValueError(f"the server's {named} {value!r} is not one of {', '.join(FRONTS)}")
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
