"""The server's settings: the schema of everything `mhaserve serve` can be told, with its defaults and checks.

Every option is a field of `Settings` whose metadata holds its help text and its parser; the CLI
(`mhaserve.cli.options`) derives each flag (`--max-wait-ms`) and environment variable
(`MHASERVE_MAX_WAIT_MS`) from the field, so defaults live here and nowhere else. Only the CLI, the
server's start-up (server.py) and the supervisor of several servers (processes.py) read a Settings: every
component gets plain values (paths, Limits, keys).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import ipaddress
import math
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mhaserve.runtime import manifest as mf
from mhaserve.runtime.cpus import available_cpus
from mhaserve.runtime.devices import DEVICES, Device, wants_cuda
from mhaserve.runtime.repository import GRAPHS, GraphChoice
from mhaserve.service import connections, incoming
from mhaserve.service.auth import KEY_RULE, OPEN_METHODS, is_valid_key
from mhaserve.service.batching import BATCHING, CPU_LIMITS, CUDA_LIMITS, Batching, Limits
from mhaserve.service.kserve.servicer import REPOSITORY_METHODS as KSERVE_REPOSITORY_METHODS
from mhaserve.service.models import ALL_MODELS, CONTROLS, Control
from mhaserve.service.rpc.methods import METHODS

ENV_PREFIX = "MHASERVE_"
LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1


class SettingsError(ValueError):
    """A setting that cannot be used; the message names the flag and the variable."""


def _opt(
    help: str, parse: Callable[[str], Any] = str, choices: tuple[str, ...] | None = None, metavar: str | None = None
) -> dict[str, Any]:
    return {"help": help, "parse": parse, "choices": choices, "metavar": metavar}


def _by_device(limit: str) -> str:
    """A limit's default as --help gives it: once where both devices share it."""
    cpu, cuda = getattr(CPU_LIMITS, limit), getattr(CUDA_LIMITS, limit)
    return str(cpu) if cpu == cuda else f"{cpu} on CPU, {cuda} on CUDA"


def _int_or_none(s: str) -> int | None:
    return None if s.strip().lower() in ("", "none", "auto") else int(s)


# argparse names a type by its __name__ when it refuses a value: "invalid _int_or_none value: 'abc'" told the
# user nothing; these now read as int's and float's own ("invalid int value: 'abc'").
_int_or_none.__name__ = "int"


def parse_bool(s: str) -> bool:
    """true/false, yes/no, on/off, 1/0 (case-insensitive): how a boolean is written in a variable."""
    value = s.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def _float_or_none(s: str) -> float | None:
    return None if s.strip().lower() in ("", "none", "auto") else float(s)


_float_or_none.__name__ = "float"


# --process-timeout's least value but 0 (Settings.__post_init__ says why)
MIN_PROCESS_TIMEOUT_S = 3.0


@dataclass(frozen=True, repr=False)
class ApiKeys:
    """API keys from the environment. repr and str show how many, never the keys (settings get logged)."""

    keys: tuple[str, ...] = ()

    @classmethod
    def parse(cls, s: str) -> ApiKeys:
        keys = tuple(k.strip() for k in s.split(",") if k.strip())
        if not keys and s:
            # "," or " ": meant to hold keys, holds none; read as no keys, it served everyone.
            raise ValueError("it names no key")
        if not all(is_valid_key(k) for k in keys):
            # a usage error here, as the same key in a keys file is: the server refused it only as it started (1)
            raise ValueError(KEY_RULE)
        return cls(keys)

    def __repr__(self) -> str:
        return f"ApiKeys(<{len(self.keys)} masked>)"

    __str__ = __repr__

    def __bool__(self) -> bool:
        return bool(self.keys)


def _names(s: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in s.split(",") if n.strip())


def _model_names(s: str) -> tuple[str, ...]:
    """--model's comma-separated names. One that names none (',') is refused, as MHASERVE_API_KEYS=',' is: read as
    none given, it served the default model without a word."""
    if not (names := _names(s)):
        raise SettingsError(f"{s!r} names no model")
    return names


_DEFAULT_PORTS = {"http": 80, "https": 443}


_HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")


def _origin(given: str) -> str:
    """An origin as a browser's Origin header writes it (`scheme://host[:port]`: the scheme and host in lower case,
    an IP address in its shortest form, no default port), or `*`; SettingsError for what no Origin header can be
    (a path, even a lone trailing slash; a user; a port out of range): it would match no page. A host that is not
    ASCII is refused, to be written in punycode (xn--...) as browsers send it: IDNA's versions map some names
    differently (straße), and a guess that matches no page is worse than the question."""
    origin = given.strip()
    if origin == "*":
        return origin
    try:
        parts = urlsplit(origin)
        port, host = parts.port, parts.hostname or ""
    except ValueError:
        parts, port, host = urlsplit(""), -1, ""
    scheme = parts.scheme.lower()
    with contextlib.suppress(ValueError):
        host = ipaddress.ip_address(host).compressed  # 127.0.0.1, ::1: as browsers write an address
        host = f"[{host}]" if ":" in host else host
    if (
        scheme not in _DEFAULT_PORTS
        or not (_HOST_NAME.fullmatch(host) or host.startswith("[") or _is_ipv4(host))
        or _looks_numeric(host)
        or "%" in host  # an IPv6 zone: no browser sends one
        or origin.partition("://")[2] != parts.netloc  # a path, a query, a fragment
        or parts.username is not None
        or parts.netloc.endswith(":")
        or port == -1
    ):
        ascii_only = "; write a host that is not ASCII in punycode (xn--...)" if not host.isascii() else ""
        raise SettingsError(
            f"{given!r} is not an origin: write scheme://host[:port] with no path (not even a trailing /), "
            f"or *{ascii_only}"
        )
    return f"{scheme}://{host}" + ("" if port in (None, _DEFAULT_PORTS[scheme]) else f":{port}")


def _is_ipv4(host: str) -> bool:
    with contextlib.suppress(ValueError):
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    return False


def _looks_numeric(host: str) -> bool:
    """A host of digits and dots that is not an IPv4 address in its usual form (127.1, 0x7f.0.0.1): browsers read
    it as an address and send its usual form, which this is not."""
    last = host.rstrip(".").rpartition(".")[2]
    return bool(last) and (last.isdigit() or last.lower().startswith("0x")) and not _is_ipv4(host)


def _origins(s: str) -> tuple[str, ...]:
    """--cors-allow-origin's comma-separated origins (`_origin`); one that names none is refused, as --model's is:
    read as none given, it would leave every page refused without a word."""
    if not (origins := _names(s)):
        raise SettingsError(f"{s!r} names no origin")
    return tuple(dict.fromkeys(_origin(o) for o in origins))


def _path_or_none(s: str) -> Path | None:
    return Path(s) if s.strip() else None


# What --open-methods may name: each method of the gRPC port but the repository API's, and each service's `/*`.
_OPENABLE = (
    *(m for m in METHODS if m not in KSERVE_REPOSITORY_METHODS),
    *(f"/{service}/*" for service in dict.fromkeys(m[1:].rpartition("/")[0] for m in METHODS)),
)


def _methods(s: str) -> tuple[str, ...]:
    # "none" too: through the environment an empty MHASERVE_OPEN_METHODS means unset (the default), not none
    if s.strip().lower() == "none":
        return ()
    return tuple(m.strip() for m in s.split(",") if m.strip())


def _same_listener(a: str, b: str) -> bool:
    """Whether listeners on hosts `a` and `b` would take the same port of one address: the same text, "" (every
    address), the same address (two names of one, localhost and 127.0.0.1, are seen as one), IPv4's every-address
    and an IPv4 address, or IPv6's (::), which the listeners bind dual-stack, and any. A name that does not
    resolve is left to the bind, which says so."""
    if a == b or "" in (a, b):
        return True
    try:
        found = [{(i[0], i[4][0]) for i in socket.getaddrinfo(h.strip("[]"), None)} for h in (a, b)]
    except (OSError, UnicodeError):  # (IDNA refuses a label empty or past 63 characters: "bad..host")
        return False
    every = {"0.0.0.0", "::"}
    return any(
        xa == xb or "::" in (xa, xb) or (fa == fb and (xa in every or xb in every))  # ::, dual-stack, takes IPv4's too
        for fa, xa in found[0]
        for fb, xb in found[1]
    )


@dataclass(frozen=True)
class Settings:
    """Everything `mhaserve serve` can be told. Limits left as None take the device's defaults."""

    repository: Path = field(default=Path("models"), metadata=_opt("model repository directory", Path))
    model: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "a model to serve, repeatable (the variable takes a comma-separated list); '*' serves every model "
            "of the repository; requests that name no model get the first (default: all-minilm-l6-v2 if "
            "present, else the first in the repository)",
            _model_names,
            metavar="NAME",
        )
        | {"repeatable": True},
    )
    model_control: Control = field(
        default="none",
        metadata=_opt(
            "how the served versions change while serving: none (the models named, at start-up), poll (read the "
            "repository every --repository-poll-s), explicit (the KServe repository API loads and unloads)",
            str,
            CONTROLS,
        ),
    )
    repository_poll_s: float = field(
        default=5.0,
        metadata=_opt(
            "with --model-control poll, seconds between readings of the repository", float, metavar="SECONDS"
        ),
    )
    host: str = field(default="127.0.0.1", metadata=_opt("address to listen on"))
    port: int = field(default=50051, metadata=_opt("gRPC port (0 picks a free one)", int))
    metrics_port: int = field(default=8000, metadata=_opt("Prometheus metrics port (0 disables)", int))
    metrics_host: str = field(
        default="",
        metadata=_opt(
            "address the metrics port listens on (default: --host's); e.g. 127.0.0.1 or a private address "
            "when --host is public, since the metrics port has no keys and no TLS",
            str,
        ),
    )
    http_port: int = field(
        default=8080,
        metadata=_opt("HTTP port: OpenAI embeddings, KServe v2 REST, /tokenize, /info, /health (0 disables)", int),
    )
    cors_allow_origin: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "an origin whose web pages may call the HTTP API from a browser (CORS), as https://app.example.com, "
            "repeatable (the variable takes a comma-separated list); * for any (default: none, a browser refuses "
            "pages of other origins the answers)",
            _origins,
            metavar="ORIGIN",
        )
        | {"repeatable": True},
    )
    device: Device = field(default="auto", metadata=_opt("where to run the model", str, DEVICES))
    graph: GraphChoice = field(
        default="auto",
        metadata=_opt(
            "graph variant (auto: the fused graph for the device: optimized-cpu on a CPU, optimized on CUDA and "
            "in entries exported before optimized-cpu, else fp32); int8's vectors are close to fp32's, not equal: "
            "do not mix them in one index (README: the int8 graph)",
            str,
            GRAPHS,
        ),
    )
    max_batch_tokens: int | None = field(
        default=None,
        metadata=_opt(
            f"token budget of one batch, padding included (default {CPU_LIMITS.max_batch_tokens} on CPU, "
            f"{CUDA_LIMITS.max_batch_tokens} on CUDA); a larger request's batch takes half while smaller requests "
            "come",
            _int_or_none,
        ),
    )
    max_wait_ms: float | None = field(
        default=None,
        metadata=_opt(
            "longest a batch's first input waits for requests still being tokenised to join its batch, or, with "
            "several inference workers, beside a batch computing, for its batch's share of the inputs; a batch "
            f"starts at once when neither is so (default {CPU_LIMITS.max_wait_ms} on CPU, {CUDA_LIMITS.max_wait_ms} "
            "on CUDA)",
            _float_or_none,
        ),
    )
    max_queue_size: int | None = field(
        default=None,
        metadata=_opt(
            "inputs that may wait for the model; past it RESOURCE_EXHAUSTED "
            f"(default {_by_device('max_queue_size')}: four requests of the most inputs a request holds by default, "
            "so that one as large as OpenAI's need not find the queue empty)",
            _int_or_none,
        ),
    )
    max_client_batch_size: int | None = field(
        default=None,
        metadata=_opt(
            f"most inputs in one request (default {_by_device('max_client_batch_size')}, as OpenAI takes: "
            "OpenAI-compatible clients send batches of their own size up to it, and none splits a refused one)",
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
    max_incoming_bytes: int | None = field(
        default=None,
        metadata=_opt(
            "request bytes held at once while they arrive (incomplete HTTP bodies; on the lean gRPC front, messages "
            "still arriving or not yet read by their call), across the process's connections: a request past it is "
            f"refused RESOURCE_EXHAUSTED / 429, retry later (default {incoming.DEFAULT_LIMIT >> 20} MiB, or twice "
            "--max-message-bytes if that is more)",
            _int_or_none,
        ),
    )
    max_connections: int | None = field(
        default=None,
        metadata=_opt(
            "client connections held open at once, the lean gRPC front's and HTTP's together: past it a new "
            "connection closes the oldest that has sent no request yet, or with none such is closed at once "
            "(HTTP answers it 503 first); grpc.aio's front counts its own (default: "
            f"the process's open-file limit, raised to its hard limit at start-up, less {connections.RESERVE}, at "
            f"most {connections.DEFAULT_LIMIT})",
            _int_or_none,
        ),
    )
    batching: Batching = field(
        default="length",
        metadata=_opt("batch by similar length (less padding) or strictly in arrival order", str, BATCHING),
    )
    grace_period: float = field(
        default=30.0,
        metadata=_opt("seconds in-flight requests get to finish on SIGTERM/SIGINT", float, metavar="SECONDS"),
    )
    drain_delay: float = field(
        default=0.0,
        metadata=_opt(
            "on SIGTERM, seconds to report NOT_SERVING while still serving, so that balancers and Kubernetes "
            "endpoints stop sending here before anything is refused; then what still comes is refused at the "
            "HTTP/2 level (GOAWAY), which proxies retry elsewhere (SIGINT drains at once)",
            float,
            metavar="SECONDS",
        ),
    )
    loading_wait: float = field(
        default=0.0,
        metadata=_opt(
            "seconds a request that arrives while the model loads waits for it (never past its gRPC deadline; "
            "at most --max-queue-size requests) before it is refused with UNAVAILABLE / HTTP 503 (0: refused at "
            "once). For replicas behind a balancer that may send calls before its health checks have seen them "
            "(docs/deploy.md)",
            float,
            metavar="SECONDS",
        ),
    )
    intra_op_threads: int | None = field(
        default=None,
        metadata=_opt(
            "ONNX Runtime threads per inference, for every batch (default: all cores for a batch that computes "
            "alone and, with several inference workers, a worker's share for one that starts while another computes)",
            _int_or_none,
            metavar="N",
        ),
    )
    inference_workers: int | None = field(
        default=None,
        metadata=_opt(
            "batches computed at once (default auto: on a CPU of 2 cores or more one per two cores, at least 2 and "
            "at most 8; on one core or CUDA 1; cores are those this process may use, its affinity and cgroup quota "
            "counted). "
            "A batch alone gets every core; one that starts while another computes runs on a second ONNX Runtime "
            "session (the graph loaded twice) with its share of the cores: more throughput under many clients, "
            "the same for a lone request; with 2 or more, one batch more is formed while they compute and starts "
            "as soon as one is free (figures: docs/benchmarks.md)",
            _int_or_none,
            metavar="N",
        ),
    )
    processes: int = field(
        default=1,
        metadata=_opt(
            "server processes on the same gRPC and HTTP ports (SO_REUSEPORT: the kernel spreads connections over "
            "them), each with its own interpreter, model session and batcher, sized by its share of the cores, under "
            "one supervisor, which serves all their metrics on --metrics-port (labelled by process; process i's alone "
            "on --metrics-port + 1 + i). On a CPU the processes share every core: a batch that starts while no "
            "process computes takes them all, so a lone request runs on every core too; on a GPU, or with "
            "--intra-op-threads, each is pinned to its share. For GPU hosts, where one process's Python, not the "
            "GPU, bounds one-text requests (docs/gpu.md); on a small CPU host one process with its inference "
            "workers serves as much, for half the memory (docs/benchmarks.md). Not with --model-control explicit",
            int,
            metavar="N",
        ),
    )
    process_timeout: float = field(
        default=30.0,
        metadata=_opt(
            "with --processes: seconds a process's event loop may go without a turn (the process stuck, or stopped) "
            "before the supervisor kills it and starts it again, as gunicorn's --timeout does; its listening sockets "
            "took a share of the new connections meanwhile, which waited for their deadlines. Watched once it "
            f"serves. At least {MIN_PROCESS_TIMEOUT_S:g}; 0: never",
            float,
            metavar="SECONDS",
        ),
    )
    grpc_front: str = field(
        default="lean",
        metadata=_opt(
            "what serves the gRPC port: lean (HTTP/2 and gRPC's framing in the event loop's own thread: less CPU "
            "and latency a call) or grpc (grpc.aio's server, on grpc core's HTTP/2); every service and method the "
            "same on both; docs/grpc-fronts.md says where they differ",
            str.lower,
            ("grpc", "lean"),
        ),
    )
    reuse_port: bool = field(
        default=False,
        metadata=_opt(
            "let other processes of this user listen on the same gRPC and HTTP ports (SO_REUSEPORT); --processes "
            "sets it for its own (default: off, a port in use is an error)",
            parse_bool,
        ),
    )
    log_level: str = field(default="info", metadata=_opt("log level", str.lower, LOG_LEVELS))
    # On, as text-embeddings-inference's since v1.9.2 and as sentence-transformers cuts a text at max_seq_length:
    # RAG frameworks' default chunks (LlamaIndex's 1,024 tokens) and TEI's clients expect a long text embedded.
    auto_truncate: bool = field(
        default=True,
        metadata=_opt(
            "cut inputs longer than the model's maximum instead of refusing them, where a request does not say: "
            "its own truncate wins, false included (tei.v1's false is unset, as TEI's proto3 bool has it); "
            "--no-auto-truncate refuses them",
            parse_bool,
        ),
    )
    http_header_timeout: float = field(
        default=10.0,
        metadata=_opt(
            "seconds an HTTP client gets to send a request's headers (and a gRPC client its HTTP/2 preface), "
            "a slower one disconnected, and then its body, a slower one answered 408 (on the lean gRPC front, "
            "each request message, a slower one INVALID_ARGUMENT)",
            float,
            metavar="SECONDS",
        ),
    )
    max_connection_age: float = field(
        default=0.0,
        metadata=_opt(
            "seconds a gRPC connection lives before the server asks its client to connect again (a GOAWAY; "
            "calls in flight get 5 more minutes), so that clients spread over replicas added since: a gRPC "
            "connection otherwise stays with its replica for good, through a Kubernetes Service or a headless "
            "one (0: no limit)",
            float,
            metavar="SECONDS",
        ),
    )
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
            "PEM certificate chain: serve gRPC over TLS and HTTP as HTTPS, with --tls-key (default: plaintext)",
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
            "file of API keys, one per line (whole-line '#' comments and blank lines ignored); calls must send "
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
    admin_keys_file: Path | None = field(
        default=None,
        metadata=_opt(
            "file of admin keys, one per line: with API keys configured, the repository API (load, unload, "
            "index) wants one of these; MHASERVE_ADMIN_KEYS adds comma-separated keys (default: none, so the "
            "repository API is closed whenever API keys are configured). Admin keys alone turn keys on too: "
            "every other call then wants one of them",
            _path_or_none,
            metavar="FILE",
        ),
    )
    # No flag, as for api_keys.
    admin_keys: ApiKeys = field(
        default=ApiKeys(),
        metadata=_opt("admin keys, comma-separated, besides those of --admin-keys-file", ApiKeys.parse)
        | {"env_only": True},
    )
    open_methods: tuple[str, ...] = field(
        default=OPEN_METHODS,
        metadata=_opt(
            "gRPC methods callable without an API key: comma-separated full names of this server's methods, "
            "'/pkg.Service/*' for a whole service (the repository API's index, load and unload never: they want an "
            "admin key; a name the server has not is refused), '' or none for none "
            f"(default: {','.join(OPEN_METHODS)})",
            _methods,
            metavar="METHODS",
        ),
    )

    def __post_init__(self) -> None:
        if Path(self.repository).is_file():  # else refused at load as "(no such folder)", with export suggested there
            raise SettingsError(f"--repository: {self.repository} is a file, not a folder")
        if isinstance(self.model, str):  # Settings(model="tiny"): one model
            object.__setattr__(self, "model", _names(self.model))
        origins = self.cors_allow_origin
        try:  # Settings(cors_allow_origin="*"): one origin
            normal = _origins(origins) if isinstance(origins, str) else tuple(dict.fromkeys(map(_origin, origins)))
        except SettingsError as e:
            raise SettingsError(f"--cors-allow-origin: {e}") from None
        object.__setattr__(self, "cors_allow_origin", normal)
        # A model named twice is served once (the start-up log said "until tiny, tiny are loaded").
        object.__setattr__(self, "model", tuple(dict.fromkeys(self.model)))
        for name in self.model:
            # Found only as the server started: "cannot start: invalid model name 'Bad/Name'", exit 1, naming
            # neither the flag nor the variable (export's and import's --name refuse it as a usage error).
            if name != ALL_MODELS:
                try:
                    mf.check_name(name)
                except mf.ManifestError as e:
                    raise SettingsError(f"--model: {e}") from None

        def positive(name: str, value: float | None, *, zero: bool = False) -> None:
            # NaN compares false both ways: without the isfinite test "nan" passed, and a NaN timeout
            # would turn the watchdog off without a word.
            if value is not None and (not math.isfinite(value) or value < 0 or (value == 0 and not zero)):
                bound = ">= 0" if zero else "> 0"
                # "must be >= 0, got inf" contradicted itself
                what = bound if math.isfinite(value) else f"a finite number {bound}"
                raise SettingsError(f"{flag(name)} must be {what}, got {value}")

        for name in (
            "max_batch_tokens",
            "max_queue_size",
            "max_client_batch_size",
            "max_message_bytes",
            "max_connections",
        ):
            positive(name, getattr(self, name))
        if self.max_message_bytes > MAX_GRPC_MESSAGE_BYTES:  # grpc core reads its channel arguments as C ints
            raise SettingsError(
                f"--max-message-bytes must be at most {MAX_GRPC_MESSAGE_BYTES} (gRPC's limit), "
                f"got {self.max_message_bytes}"
            )
        if self.max_incoming_bytes is None:
            object.__setattr__(self, "max_incoming_bytes", incoming.default_limit(self.max_message_bytes))
        elif self.max_incoming_bytes < self.max_message_bytes + 5:
            raise SettingsError(
                f"{flag('max_incoming_bytes')} must be at least {flag('max_message_bytes')} + 5 "
                f"({self.max_message_bytes + 5}: a message at that limit, with gRPC's 5-byte prefix, must fit), "
                f"got {self.max_incoming_bytes}"
            )
        for name in ("max_wait_ms", "grace_period", "drain_delay", "loading_wait", "process_timeout"):
            positive(name, getattr(self, name), zero=True)
        if 0 < self.process_timeout < MIN_PROCESS_TIMEOUT_S:
            # a process notes its loop's turn once a second, and the supervisor looks twice a second: below this, a
            # healthy process would be killed for the time between two notes
            raise SettingsError(
                f"{flag('process_timeout')} must be 0 (never) or at least {MIN_PROCESS_TIMEOUT_S:g} (seconds), "
                f"got {self.process_timeout:g}"
            )
        positive("intra_op_threads", self.intra_op_threads)
        positive("inference_workers", self.inference_workers)
        positive("processes", self.processes)
        if self.max_padding is not None and not 0 <= self.max_padding <= 1:
            raise SettingsError(f"--max-padding must be a fraction in [0, 1], got {self.max_padding}")
        for name in ("port", "metrics_port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise SettingsError(f"{flag(name)} must be a port number in [0, 65535], got {getattr(self, name)}")
        if self.metrics_port and self.processes > 1 and self.metrics_port + self.processes > 65535:
            # each process's own (processes.py): past 65535 the supervisor refused it only as it claimed its ports
            first = 65535 - self.metrics_port  # the first process whose port would pass it
            raise SettingsError(
                f"{flag('metrics_port')} {self.metrics_port} with {flag('processes')} {self.processes}: process "
                f"{first}'s metrics port ({flag('metrics_port')} + 1 + {first}) would be 65536, past 65535"
            )
        # One port for two listeners failed only at bind, after the model had loaded, with exit 1.
        ports = [(flag(n), getattr(self, n)) for n in ("port", "http_port") if getattr(self, n)]
        if self.metrics_port and _same_listener(self.metrics_address, self.host):
            ports.append((flag("metrics_port"), self.metrics_port))
            if self.processes > 1:  # and each process's own (processes.py); the supervisor failed with a traceback
                own = "process {i}'s metrics port (" + flag("metrics_port") + " + 1 + {i})"
                ports += [(own.format(i=i), self.metrics_port + 1 + i) for i in range(self.processes)]
        for i, (a, pa) in enumerate(ports):
            if same := [b for b, pb in ports[i + 1 :] if pb == pa]:
                raise SettingsError(f"{a} and {same[0]} are both {pa}: each listener needs its own port")
        positive("repository_poll_s", self.repository_poll_s)
        # Every field with choices, from its own metadata: a list kept by hand here once lacked --grpc-front, and
        # MHASERVE_GRPC_FRONT=nope served on grpc.aio's front without a word (argparse checks only the flags).
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (choices := f.metadata.get("choices")) and value not in choices:
                raise SettingsError(f"{flag(f.name)} must be one of {', '.join(choices)}, got {value!r}")
        if self.processes > 1 and self.model_control == "explicit":
            raise SettingsError(
                "--model-control explicit needs --processes 1: a load or unload call would reach only the process "
                "that accepted its connection (poll works: every process reads the repository)"
            )
        # Refused here, before anything listens or loads, with the device's defaults for what is not set (a
        # model's serving.json limits are checked at load). `auto` is resolved only where its two devices' defaults
        # disagree (a --max-client-batch-size that fits one device's default queue, not the other's): on a GPU host
        # that imports ONNX Runtime and tries CUDA, which the server does next anyway (the answer is cached).
        pairs = {
            name: (self.max_client_batch_size or base.max_client_batch_size, self.max_queue_size or base.max_queue_size)
            for name, base in (("cpu", CPU_LIMITS), ("cuda", CUDA_LIMITS))
        }
        device = self.device
        if device == "auto" and len({client > queue for client, queue in pairs.values()}) > 1:
            device = "cpu" if on_cpu(device) else "cuda"
        for name, (client, queue) in pairs.items():
            if device in ("auto", name):
                _check_client_batch(client, queue)
        positive("inference_timeout", self.inference_timeout, zero=True)
        positive("http_header_timeout", self.http_header_timeout)
        positive("max_connection_age", self.max_connection_age, zero=True)
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
            # Each was taken without a word: a repository method stayed behind its admin key while the log called
            # it open, and a name no service has opened nothing, and (the defaults replaced) closed the probes.
            if method in KSERVE_REPOSITORY_METHODS:
                raise SettingsError(
                    f"--open-methods: {method!r} is the repository API's, which always wants an admin key "
                    "(--admin-keys-file, MHASERVE_ADMIN_KEYS): it cannot be opened"
                )
            if method not in _OPENABLE:
                close = difflib.get_close_matches(method, _OPENABLE, n=1)
                raise SettingsError(
                    f"--open-methods: {method!r} is no method of this server"
                    + (f"; did you mean {close[0]}?" if close else "")
                )

    def inert(self) -> list[tuple[str, str]]:
        """The settings given a value of their own that the others leave without effect, each with why. Not
        refused (a deployment's variables may set more than one command line uses), but not silent either:
        MHASERVE_REPOSITORY_POLL_S=1 without polling served what start-up loaded, and said nothing."""
        inert = []
        if self.repository_poll_s != Settings.repository_poll_s and self.model_control != "poll":
            inert.append(
                ("repository_poll_s", f"is read only with {flag('model_control')} poll, not {self.model_control}")
            )
        if self.process_timeout != Settings.process_timeout and self.processes == 1:
            inert.append(("process_timeout", f"watches the processes of {flag('processes')} 2 or more, not 1"))
        if self.metrics_host and not self.metrics_port:
            inert.append(("metrics_host", f"has no listener to place: {flag('metrics_port')} is 0"))
        if self.cors_allow_origin and not self.http_port:
            inert.append(("cors_allow_origin", f"has no HTTP API to open to pages: {flag('http_port')} is 0"))
        if self.max_padding is not None and self.batching != "length":
            inert.append(("max_padding", f"is read only with {flag('batching')} length, not {self.batching}"))
        keys = self.api_keys_file or self.admin_keys_file or self.api_keys.keys or self.admin_keys.keys
        if self.open_methods != OPEN_METHODS and not keys:
            inert.append(
                (
                    "open_methods",
                    f"has nothing to open: with no API keys ({flag('api_keys_file')}, MHASERVE_API_KEYS) every "
                    "method is open",
                )
            )
        return inert

    @property
    def metrics_address(self) -> str:
        """Where the metrics port listens: --metrics-host, else --host."""
        return self.metrics_host or self.host

    @property
    def workers(self) -> int:
        """The inference workers in force: --inference-workers, else the choice for the device and its cores."""
        return self.workers_on(available_cpus())

    def workers_on(self, cpus: int) -> int:
        """The inference workers in force for a process that sizes itself by `cpus` cores."""
        return self.inference_workers or auto_inference_workers(self.device, cpus)

    def limits(self, *, on_cuda: bool, model: Mapping[str, float] | None = None) -> Limits:
        """The limits in force: a model's own (its serving.json `limits`), then those set here, then the
        device's defaults."""
        base = CUDA_LIMITS if on_cuda else CPU_LIMITS
        limits = Limits(
            max_batch_tokens=self.max_batch_tokens or base.max_batch_tokens,
            max_wait_ms=base.max_wait_ms if self.max_wait_ms is None else self.max_wait_ms,
            max_queue_size=self.max_queue_size or base.max_queue_size,
            max_client_batch_size=self.max_client_batch_size or base.max_client_batch_size,
            max_padding=base.max_padding if self.max_padding is None else self.max_padding,
        )
        if model:
            limits = dataclasses.replace(limits, **{k: type(getattr(limits, k))(v) for k, v in model.items()})
        # One from serving.json and one from the flags: named as such, not as two flags the operator never set.
        from_file = bool({"max_client_batch_size", "max_queue_size"} & set(model or ()))
        _check_client_batch(limits.max_client_batch_size, limits.max_queue_size, from_file=from_file)
        return limits


def _check_client_batch(client: int, queue: int, *, from_file: bool = False) -> None:
    if client > queue:
        said = (
            "the model's serving.json limits with the server's: max_client_batch_size ({}) exceeds max_queue_size ({})"
            if from_file
            else "--max-client-batch-size ({}) exceeds --max-queue-size ({})"
        )
        raise SettingsError(said.format(client, queue) + ": such a request could never be queued")


# The most workers `--inference-workers auto` gives, whatever the core count (see auto_inference_workers).
MAX_AUTO_WORKERS = 8


def worker_threads(cpus: int, workers: int) -> int:
    """ONNX Runtime's threads for a batch that starts while another computes: its worker's share of `cpus`
    (more threads than cores would only preempt each other)."""
    return max(1, cpus // workers)


def auto_inference_workers(device: str, cpus: int) -> int:
    """`--inference-workers auto`: on a CPU of two cores or more one per two of its `cpus`, at least 2 and at most
    8, whatever the graph; on one core, or on CUDA, one.

    On 2 cores at 32 clients (docs/benchmarks.md) a second worker overlaps the work around one batch (answering it,
    taking in the next) with the next batch's compute. For the int8 graph it gained 16-17 % (AMD EPYC with AVX-512
    VNNI) and 27-56 % (Intel Xeon with VNNI), with a lower p99. For the fused fp32 graph the first measurements
    (2026-11-24/25, a Zen 3 AMD EPYC and an Intel Xeon) gave 1-19 % and a p99 on mixed texts 16-30 % higher, so it
    kept one; three alternated A/Bs on the server of 2026-11-26/27 (Zen 4 AMD EPYC, 14 rounds) gave 5-9 % more short
    texts and 6-15 % more mixed texts a second over gRPC, p50 5-20 % lower, p99 on mixed texts from 10 % lower to
    10 % higher, one client's latency unchanged (on inputs all 128 tokens long: 1.01-1.13x, p99 13-31 % higher, the
    price); so now two there too. On 16 cores (an Intel Xeon, the fused graph, short texts, 32 clients: docs/gpu.md)
    one worker left most cores spinning on batches of a few short texts: 2, 4, 8 and 16 workers served 1.26x,
    1.42-1.52x, 1.87-2.10x and 2.04x of one worker's 395-401 seq/s, with less CPU and the same one-client latency; 8
    (one per two cores) was the best. Core counts between 2 and 16 are interpolated, not measured. Past 16 cores it
    stays at 8: 16 workers were no faster on 16 cores, and every batch in flight holds its own activations (a batch
    of 32 texts of 256 tokens, about 100 MB of attention scores alone), so more workers than measured would only
    raise the peak memory. On CUDA, workers share one session: one.
    """
    if not on_cpu(device) or cpus < 2:
        return 1
    return max(2, min(cpus // 2, MAX_AUTO_WORKERS))


def on_cpu(device: str) -> bool:
    """Whether a server with this --device runs its models on the CPU: cpu, or auto on a host that shows no GPU
    (or whose ONNX Runtime has no CUDA)."""
    return not wants_cuda(device)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()
