"""The server's settings: one frozen object, built once from CLI flags, `MHASERVE_*` variables and defaults.

Every option is a field of `Settings`; its flag (`--max-wait-ms`), its environment variable
(`MHASERVE_MAX_WAIT_MS`), its parser and its help text are derived from the field, so defaults live
here and nowhere else. A flag beats its variable, which beats the default. Nothing here reads argv or
the environment at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ENV_PREFIX = "MHASERVE_"
DEVICES = ("auto", "cuda", "cpu")
GRAPHS = ("auto", "fp32", "optimized", "fp16")
BATCHING = ("length", "arrival")
LOG_LEVELS = ("debug", "info", "warning", "error")

Device = Literal["auto", "cuda", "cpu"]
GraphChoice = Literal["auto", "fp32", "optimized", "fp16"]
Batching = Literal["length", "arrival"]


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the flag and the variable."""


@dataclass(frozen=True)
class Limits:
    """The batcher's and the API's limits, once the device is known."""

    max_batch_tokens: int
    max_wait_ms: float
    max_queue_size: int
    max_client_batch_size: int
    max_padding: float  # the length policy's cap on a batch's padding, a fraction of its tokens


# A GPU turns a wide batch into throughput; a CPU gains little past a few thousand tokens and pays in
# latency, so it gets a smaller budget and a shorter wait.
#
# Padding is computed like real tokens. On a CPU, batching buys little (MiniLM on 2 cores: 1.3x from
# batch 1 to its best batch), so padding soon costs more than batching gains: on the mixed workload of
# docs/benchmarks.md a cap of 0.1 served about 10 % more than 0.2, and 0.35 about 25 % less. A GPU gains
# more from wide batches, so it may trade more padding for them (an estimate: not yet measured on a GPU).
CPU_LIMITS = Limits(
    max_batch_tokens=8192, max_wait_ms=2.0, max_queue_size=2048, max_client_batch_size=64, max_padding=0.1
)
CUDA_LIMITS = Limits(
    max_batch_tokens=32768, max_wait_ms=5.0, max_queue_size=8192, max_client_batch_size=256, max_padding=0.3
)


def _opt(
    help: str, parse: Callable[[str], Any] = str, choices: tuple[str, ...] | None = None, metavar: str | None = None
) -> dict[str, Any]:
    return {"help": help, "parse": parse, "choices": choices, "metavar": metavar}


def _int_or_none(s: str) -> int | None:
    return None if s.strip().lower() in ("", "none", "auto") else int(s)


def _float_or_none(s: str) -> float | None:
    return None if s.strip().lower() in ("", "none", "auto") else float(s)


# Callable without an API key: orchestrators' health probes, and reflection (it lists methods, answers none).
OPEN_METHODS = (
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
)


@dataclass(frozen=True, repr=False)
class ApiKeys:
    """API keys from the environment. repr and str show how many, never the keys (settings get logged)."""

    keys: tuple[str, ...] = ()

    @classmethod
    def parse(cls, s: str) -> ApiKeys:
        return cls(tuple(k.strip() for k in s.split(",") if k.strip()))

    def __repr__(self) -> str:
        return f"ApiKeys(<{len(self.keys)} masked>)"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return bool(self.keys)


def _path_or_none(s: str) -> Path | None:
    return Path(s) if s.strip() else None


def _methods(s: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in s.split(",") if m.strip())


@dataclass(frozen=True)
class Settings:
    """Everything `mhaserve serve` can be told. Limits left as None take the device's defaults."""

    repository: Path = field(default=Path("models"), metadata=_opt("model repository directory", Path))
    model: str | None = field(
        default=None,
        metadata=_opt("model to serve (default: all-minilm-l6-v2 if present, else the first in the repository)"),
    )
    host: str = field(default="127.0.0.1", metadata=_opt("address to listen on"))
    port: int = field(default=50051, metadata=_opt("gRPC port (0 picks a free one)", int))
    metrics_port: int = field(default=8000, metadata=_opt("Prometheus metrics port (0 disables)", int))
    device: Device = field(default="auto", metadata=_opt("where to run the model", str, DEVICES))
    graph: GraphChoice = field(
        default="auto", metadata=_opt("graph variant (auto: optimized if the entry has it, else fp32)", str, GRAPHS)
    )
    max_batch_tokens: int | None = field(
        default=None,
        metadata=_opt(
            f"token budget of one batch, padding included (default {CPU_LIMITS.max_batch_tokens} on CPU, "
            f"{CUDA_LIMITS.max_batch_tokens} on CUDA)",
            _int_or_none,
        ),
    )
    max_wait_ms: float | None = field(
        default=None,
        metadata=_opt(
            f"longest a request waits for a batch to fill (default {CPU_LIMITS.max_wait_ms} on CPU, "
            f"{CUDA_LIMITS.max_wait_ms} on CUDA)",
            _float_or_none,
        ),
    )
    max_queue_size: int | None = field(
        default=None,
        metadata=_opt(
            "inputs that may wait for the model; past it RESOURCE_EXHAUSTED "
            f"(default {CPU_LIMITS.max_queue_size} on CPU, {CUDA_LIMITS.max_queue_size} on CUDA)",
            _int_or_none,
        ),
    )
    max_client_batch_size: int | None = field(
        default=None,
        metadata=_opt(
            f"most inputs in one request (default {CPU_LIMITS.max_client_batch_size} on CPU, "
            f"{CUDA_LIMITS.max_client_batch_size} on CUDA)",
            _int_or_none,
        ),
    )
    max_padding: float | None = field(
        default=None,
        metadata=_opt(
            "with --batching length, stop growing a batch before padding passes this fraction of its tokens; "
            f"1 for no cap (default {CPU_LIMITS.max_padding} on CPU, {CUDA_LIMITS.max_padding} on CUDA)",
            _float_or_none,
            metavar="FRACTION",
        ),
    )
    max_message_bytes: int = field(
        default=4 * 1024 * 1024, metadata=_opt("largest request message; past it RESOURCE_EXHAUSTED", int)
    )
    batching: Batching = field(
        default="length",
        metadata=_opt("batch by similar length (less padding) or strictly in arrival order", str, BATCHING),
    )
    grace_period: float = field(
        default=30.0,
        metadata=_opt("seconds in-flight requests get to finish on SIGTERM/SIGINT", float, metavar="SECONDS"),
    )
    intra_op_threads: int | None = field(
        default=None,
        metadata=_opt("ONNX Runtime threads per inference (default: all cores)", _int_or_none, metavar="N"),
    )
    log_level: str = field(default="info", metadata=_opt("log level", str.lower, LOG_LEVELS))
    inference_timeout: float = field(
        default=60.0,
        metadata=_opt(
            "seconds one batch may compute; past it its requests fail with UNAVAILABLE and health reports "
            "NOT_SERVING until the engine returns (0: no limit)",
            float,
            metavar="SECONDS",
        ),
    )
    tls_cert: Path | None = field(
        default=None,
        metadata=_opt(
            "PEM certificate chain: serve gRPC over TLS, with --tls-key (default: plaintext)",
            _path_or_none,
            metavar="FILE",
        ),
    )
    tls_key: Path | None = field(
        default=None, metadata=_opt("PEM private key of --tls-cert (default: none)", _path_or_none, metavar="FILE")
    )
    tls_client_ca: Path | None = field(
        default=None,
        metadata=_opt(
            "PEM CA certificates: require client certificates signed by them, mutual TLS (default: none)",
            _path_or_none,
            metavar="FILE",
        ),
    )
    api_keys_file: Path | None = field(
        default=None,
        metadata=_opt(
            "file of API keys, one per line ('#' comments, blank lines ignored); calls must send "
            "'authorization: Bearer KEY'; MHASERVE_API_KEYS adds comma-separated keys (default: no keys, no "
            "authentication)",
            _path_or_none,
            metavar="FILE",
        ),
    )
    # No flag: a key on the command line shows in `ps` and in shell history.
    api_keys: ApiKeys = field(
        default=ApiKeys(),
        metadata=_opt("API keys, comma-separated, besides those of --api-keys-file", ApiKeys.parse)
        | {"env_only": True},
    )
    open_methods: tuple[str, ...] = field(
        default=OPEN_METHODS,
        metadata=_opt(
            "methods callable without an API key: comma-separated full names, '/pkg.Service/*' for a whole "
            f"service, '' for none (default: {','.join(OPEN_METHODS)})",
            _methods,
            metavar="METHODS",
        ),
    )

    def __post_init__(self) -> None:
        def positive(name: str, value: float | None, *, zero: bool = False) -> None:
            if value is not None and (value < 0 or (value == 0 and not zero)):
                raise SettingsError(f"{flag(name)} must be {'>= 0' if zero else '> 0'}, got {value}")

        for name in ("max_batch_tokens", "max_queue_size", "max_client_batch_size", "max_message_bytes"):
            positive(name, getattr(self, name))
        for name in ("max_wait_ms", "grace_period"):
            positive(name, getattr(self, name), zero=True)
        positive("intra_op_threads", self.intra_op_threads)
        if self.max_padding is not None and not 0 <= self.max_padding <= 1:
            raise SettingsError(f"--max-padding must be a fraction in [0, 1], got {self.max_padding}")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise SettingsError(f"{flag(name)} must be a port number in [0, 65535], got {getattr(self, name)}")
        for name, choices in (
            ("device", DEVICES),
            ("graph", GRAPHS),
            ("batching", BATCHING),
            ("log_level", LOG_LEVELS),
        ):
            if getattr(self, name) not in choices:
                raise SettingsError(f"{flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        positive("inference_timeout", self.inference_timeout, zero=True)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsError("--tls-cert and --tls-key go together: set both to serve TLS, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SettingsError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        for method in self.open_methods:
            service, _, name = method[1:].partition("/")
            if not method.startswith("/") or not service or not name or "/" in name:
                raise SettingsError(
                    f"--open-methods: {method!r} is not a full method name like /grpc.health.v1.Health/Check "
                    "or /grpc.health.v1.Health/*"
                )

    def limits(self, *, on_cuda: bool) -> Limits:
        """The limits in force: those set explicitly, the device's defaults for the rest."""
        base = CUDA_LIMITS if on_cuda else CPU_LIMITS
        limits = Limits(
            max_batch_tokens=self.max_batch_tokens or base.max_batch_tokens,
            max_wait_ms=base.max_wait_ms if self.max_wait_ms is None else self.max_wait_ms,
            max_queue_size=self.max_queue_size or base.max_queue_size,
            max_client_batch_size=self.max_client_batch_size or base.max_client_batch_size,
            max_padding=base.max_padding if self.max_padding is None else self.max_padding,
        )
        if limits.max_client_batch_size > limits.max_queue_size:
            raise SettingsError(
                f"--max-client-batch-size ({limits.max_client_batch_size}) exceeds --max-queue-size "
                f"({limits.max_queue_size}): such a request could never be queued"
            )
        return limits


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; argparse keeps None for flags not given, so the environment can fill them."""
    for f in dataclasses.fields(Settings):
        meta = f.metadata
        if meta.get("env_only"):
            parser.set_defaults(**{f.name: None})  # no flag; build() reads the variable
            continue
        # Fields whose default depends on the device or the repository say so in their help.
        default = "" if "(default" in meta["help"] else f"; default: {f.default}"
        parser.add_argument(
            flag(f.name),
            dest=f.name,
            default=None,
            type=meta["parse"],
            choices=meta["choices"],
            metavar=None if meta["choices"] else meta.get("metavar") or f.name.split("_")[-1].upper(),
            help=f"{meta['help']} [env {env_var(f.name)}{default}]",
        )


def build(cli: argparse.Namespace | Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from parsed flags (None where not given), then `MHASERVE_*` variables, then the defaults."""
    given = dict(vars(cli) if isinstance(cli, argparse.Namespace) else (cli or {}))
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        if given.get(f.name) is not None:
            values[f.name] = given[f.name]
        elif env.get(env_var(f.name), "") != "":
            raw = env[env_var(f.name)]
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError:
                raise SettingsError(f"{env_var(f.name)}={raw!r} is not a valid {flag(f.name)}") from None
    return Settings(**values)
