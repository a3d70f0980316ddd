"""Locust load test for mhaserve: encoder.v1 over gRPC, or OpenAI embeddings (`POST /v1/embeddings`) or
text-embeddings-inference's `POST /embed` over HTTP.

Locust has no gRPC user of its own: `EncoderUser` makes the calls with grpcio (made gevent-friendly, so
hundreds of users share one process) and reports each one through Locust's request event, with the
gRPC status name as the failure reason. With `--protocol http` the same user sends the same workloads to
the OpenAI route instead, over geventhttpclient (Locust's FastHttpUser client: one keep-alive connection
per user), failures named by their HTTP status and the error's message (BAD_RESPONSE for a 200 whose body
is not JSON, or holds no embeddings); with `--protocol tei`, to TEI's `POST /embed`, as a client written for
text-embeddings-inference sends them.

    locust -f loadtest/locustfile.py --headless -H 127.0.0.1:50051 -u 32 -r 8 -t 60s --workload mixed
    locust -f loadtest/locustfile.py --headless -H http://127.0.0.1:8080 --protocol http -u 32 -r 8 -t 60s

Options this file adds (also settable as LOCUST_* variables, and sent by a master to its workers):

    --protocol P          grpc (encoder.v1 Encode, the default) | http (OpenAI POST /v1/embeddings) |
                          tei (text-embeddings-inference's POST /embed)
    --workload W[,W...]   short | query | long | mixed | batch | ids | stream | bad (several: picked at
                          random per task; stream is gRPC only)
    --batch-size N        texts per request for `batch` (default 8)
    --stream-requests N   requests per EncodeStream call for `stream` (default 8)
    --corpus PATH         one text per line, for query, long, mixed, batch, ids (default: loadtest/corpus.txt)
    --short-corpus PATH   the `short` workload's texts (default: loadtest/texts/short.txt)
    --tokenizer PATH      tokenizer.json for `ids` (default: random ids inside the served model's vocabulary)
    --model NAME          model to ask for (default: the server's default)
    --encoding-format F   float | base64: the vectors `http` asks for (default float)
    --rpc-timeout S       deadline of each call in seconds (default 30)
    --think-time S        pause between a user's calls, uniform in [0, S] (default 0: closed loop)
    --max-fail-ratio F    exit 1 when more than this fraction of requests failed (default 0.01); see below

A server with API keys or TLS (as `mhaserve encode`'s --api-key and --tls options; Locust's own
--tls-cert/--tls-key serve its web UI, hence the client certificate's longer names):

    --api-key KEY         sent as `authorization: Bearer KEY` on every call (default: the variable
                          MHASERVE_API_KEY, which keeps it out of ps; never logged nor shown in the web UI)
    --tls                 TLS, trusting the system's CA certificates (also: an https:// host)
    --tls-ca FILE         TLS, trusting the CA certificates in FILE (PEM)
    --tls-client-cert FILE, --tls-client-key FILE
                          a client certificate and its key (PEM), for a server with mutual TLS

A user pauses 0.1 s after UNAVAILABLE or RESOURCE_EXHAUSTED (HTTP: 429, 503, or no connection), as a
client should, instead of spinning on instant failures. A call the run's end cuts off after it waited over
twice the run's slowest call (and 1 s) is recorded as an IN_FLIGHT failure: the server stopped answering.

The exit status is 1 when more than --max-fail-ratio of the requests failed, and whatever the ratio when no
request was made, a task raised an exception, or a call was IN_FLIGHT; 2, before the run, for a bad option
or a file the users could not read (a corpus with no UTF-8 text, a tokenizer, a certificate).

`make loadtest` runs it headless and keeps the CSV, JSON and HTML reports (`PROTOCOL=http` for the HTTP
API); distributed mode works from the same file (`--master` / `--worker`, or `--processes N`).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import ssl
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from http.client import HTTPException
from pathlib import Path
from typing import Any, ClassVar

from locust import User, events, task  # imports gevent and patches the standard library first

from gevent import GreenletExit  # isort: skip

import grpc  # isort: skip
import grpc.experimental.gevent as grpc_gevent  # isort: skip
import orjson  # isort: skip
from geventhttpclient import HTTPClient  # isort: skip

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.client import CHANNEL_OPTIONS, MAX_TIMEOUT_S, Connection, with_default_port

# Before any channel exists: without it every gRPC call blocks the whole process and users run one at a time.
grpc_gevent.init_gevent()

log = logging.getLogger(__name__)
# Locust reads this file before --processes forks its workers: a process of another pid is one of those.
LOADED_BY = os.getpid()

DEFAULT_HOST = "127.0.0.1:50051"
DEFAULT_HTTP_HOST = "http://127.0.0.1:8080"  # with --protocol http and no -H
DEFAULT_CORPUS = Path(__file__).resolve().parent / "corpus.txt"
DEFAULT_SHORT_CORPUS = Path(__file__).resolve().parent / "texts" / "short.txt"
PROTOCOLS = ("grpc", "http", "tei")
HTTP_PROTOCOLS = {"http", "tei"}
WORKLOADS = ("short", "query", "long", "mixed", "batch", "ids", "stream", "bad")
GRPC_ONLY = {"stream"}
# Word counts that split corpus.txt: a query is a `query`, a paragraph a `long` text.
QUERY_MAX_WORDS = 8
LONG_MIN_WORDS = 60
STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
# After these a real client backs off rather than retrying at once: the server is unreachable or
# draining, or its queue is full. Without a pause a user would spin on instant failures.
BACKOFF_CODES = {"UNAVAILABLE", "RESOURCE_EXHAUSTED", "HTTP 429", "HTTP 503", "CONNECTION"}
BACKOFF_S = 0.1
# The server refused the run's API key (a refused client certificate fails the TLS handshake instead: UNAVAILABLE,
# CONNECTION): every call would be refused the same, so the run stops at the first (EncoderUser._fire) as a refused
# option stops it. This server answers 403 / PERMISSION_DENIED only to a client key on its admin API, which no task
# calls: from a proxy in front of it, a 403 stops the run too.
CREDENTIALS_REFUSED = {"UNAUTHENTICATED", "PERMISSION_DENIED", "HTTP 401", "HTTP 403"}
ROUTE = "/v1/embeddings"
TEI_ROUTE = "/embed"
API_KEY_ENV = "MHASERVE_API_KEY"  # as `mhaserve encode --api-key`
# A call the run's end cut off after it had waited longer than twice the slowest answer of the run, and
# at least IN_FLIGHT_MIN_S: recorded as a failure of this name (EncoderUser._in_flight says why).
IN_FLIGHT = "IN_FLIGHT"
IN_FLIGHT_MIN_S = 1.0
# The exit status of a run refused before it began (a bad option, a file the users could not read), as argparse's,
# and of one the server refused its credentials.
REFUSED_EXIT = 2
# A worker's message to its master: it refused the options the master sent (or the server its credentials), and why.
REFUSED = "mhaserve_refused"
TLS_FILES = (("tls_ca", "--tls-ca"), ("tls_client_cert", "--tls-client-cert"), ("tls_client_key", "--tls-client-key"))


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    g = parser.add_argument_group("mhaserve", "options of loadtest/locustfile.py")
    g.add_argument(
        "--protocol",
        default="grpc",
        choices=PROTOCOLS,
        env_var="LOCUST_PROTOCOL",
        help="grpc: encoder.v1 Encode (host 127.0.0.1:50051); http: OpenAI POST /v1/embeddings; tei: "
        "text-embeddings-inference's POST /embed (both host http://127.0.0.1:8080)",
    )
    g.add_argument(
        "--workload",
        default="mixed",
        env_var="LOCUST_WORKLOAD",
        help=f"comma-separated task sets, one picked at random per task: {', '.join(WORKLOADS)} (default: mixed)",
    )
    g.add_argument("--batch-size", type=int, default=8, env_var="LOCUST_BATCH_SIZE", help="texts per `batch` request")
    g.add_argument(
        "--stream-requests", type=int, default=8, env_var="LOCUST_STREAM_REQUESTS", help="requests per `stream` call"
    )
    # Defaults empty, read as the files beside this locustfile wherever it runs: a path of the master's
    # own checkout, sent to workers with its options, named nothing on a worker checked out elsewhere.
    g.add_argument(
        "--corpus", default="", env_var="LOCUST_CORPUS", help="one text per line (default: loadtest/corpus.txt)"
    )
    g.add_argument(
        "--short-corpus",
        default="",
        env_var="LOCUST_SHORT_CORPUS",
        help="the `short` workload's texts, one per line (default: loadtest/texts/short.txt)",
    )
    g.add_argument("--tokenizer", default="", env_var="LOCUST_TOKENIZER", help="tokenizer.json for the `ids` task")
    g.add_argument("--model", default="", env_var="LOCUST_MODEL", help="model name (default: the server's)")
    g.add_argument(
        "--encoding-format",
        default="float",
        choices=("float", "base64"),
        env_var="LOCUST_ENCODING_FORMAT",
        help="the vectors --protocol http asks for (default float)",
    )
    g.add_argument("--rpc-timeout", type=float, default=30.0, env_var="LOCUST_RPC_TIMEOUT", help="seconds per call")
    g.add_argument("--think-time", type=float, default=0.0, env_var="LOCUST_THINK_TIME", help="max pause, seconds")
    g.add_argument(
        "--max-fail-ratio",
        type=float,
        default=0.01,
        env_var="LOCUST_MAX_FAIL_RATIO",
        help="exit 1 only when more than this fraction of requests failed (default 0.01)",
    )
    s = parser.add_argument_group(
        "mhaserve security", "a server with API keys or TLS (options of loadtest/locustfile.py)"
    )
    # Read from the environment by default, as `mhaserve encode` does: a key on the command line shows in ps.
    # An argument group's options stay out of the web UI, whose form would carry the key in its page.
    s.add_argument(
        "--api-key",
        default="",
        env_var=API_KEY_ENV,
        metavar="KEY",
        help=f"sent as 'authorization: Bearer KEY' on every call [default: ${API_KEY_ENV}]",
    )
    s.add_argument(
        "--tls",
        action="store_true",
        default=False,
        env_var="LOCUST_TLS",
        help="use TLS, trusting the system's CA certificates (an https:// host does too)",
    )
    s.add_argument(
        "--tls-ca", default="", env_var="LOCUST_TLS_CA", metavar="FILE", help="use TLS, trusting the CA in FILE (PEM)"
    )
    s.add_argument(
        "--tls-client-cert",
        default="",
        env_var="LOCUST_TLS_CLIENT_CERT",
        metavar="FILE",
        help="client certificate for mutual TLS (PEM; Locust's own --tls-cert is its web UI's)",
    )
    s.add_argument(
        "--tls-client-key", default="", env_var="LOCUST_TLS_CLIENT_KEY", metavar="FILE", help="its private key (PEM)"
    )


class CallError(Exception):
    """A failed call as Locust records it: its repr, the failure's key, starts with the status name
    (a gRPC status, or `HTTP 400`)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details

    def __repr__(self) -> str:
        # Locust groups failures by repr(): keep it free of per-request noise (ids, addresses).
        return f"{self.code}: {self.details[:200]}"

    __str__ = __repr__

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> CallError:
        code = e.code() if isinstance(e, grpc.Call) else None
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        return cls(code.name if code is not None else "UNKNOWN", details or "")

    @classmethod
    def from_http(cls, status: int, body: bytes) -> CallError:
        """OpenAI's error shape ({"error": {"message": ...}}), KServe's and TEI's ({"error": "..."}), or the raw
        body."""
        try:
            error = orjson.loads(body)["error"]
            message = error["message"] if isinstance(error, dict) else str(error)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message = body[:200].decode("utf-8", "replace")
        return cls(f"HTTP {status}", message)


class Corpus:
    """The texts the users send, split by length once per process."""

    _cache: dict[str, Corpus] = {}

    def __init__(self, lines: list[str]) -> None:
        if not lines:
            raise ValueError("the corpus is empty")
        self.all = lines
        self.queries = [t for t in lines if len(t.split()) <= QUERY_MAX_WORDS] or lines
        self.long = [t for t in lines if len(t.split()) >= LONG_MIN_WORDS] or lines

    @classmethod
    def load(cls, path: str) -> Corpus:
        if path not in cls._cache:
            text = Path(path).read_text(encoding="utf-8")
            cls._cache[path] = cls([line.strip() for line in text.splitlines() if line.strip()])
        return cls._cache[path]


def _token_ids(corpus: Corpus, tokenizer_path: str, vocab_size: int, max_tokens: int) -> list[list[int]]:
    """Pre-tokenised inputs: the corpus through the model's tokenizer, or random ids of similar lengths."""
    if tokenizer_path:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer_path)
        tok.enable_truncation(max_length=max_tokens)
        return [e.ids for e in tok.encode_batch(corpus.all)]
    rng = random.Random(0)
    # ~1.3 word pieces per word plus two special tokens, inside the vocabulary the server reported.
    lengths = [min(max_tokens, 2 + int(1.3 * len(t.split()))) for t in corpus.all]
    return [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]


_ids_cache: dict[tuple[str, str, int, int], list[list[int]]] = {}

# What a call returns to the user: (response size in bytes, embeddings received)
Answer = tuple[int, int]


def connection(opt: dict[str, Any], host: str) -> Connection:
    """How a user reaches the server, as `mhaserve encode` does: TLS with --tls, --tls-ca, a client
    certificate or an https:// host, and the API key as bearer metadata. The key is --api-key, sent by a
    master to its workers, or else this process's own MHASERVE_API_KEY (a worker's, when the master has none)."""

    def path(name: str) -> Path | None:
        return Path(opt[name]) if opt.get(name) else None

    return Connection(
        tls=bool(opt.get("tls")) or host.startswith(("https://", "grpcs://")),
        ca=path("tls_ca"),
        cert=path("tls_client_cert"),
        key=path("tls_client_key"),
        api_key=opt.get("api_key") or os.environ.get(API_KEY_ENV) or None,
    )


def uses_tls(conn: Connection) -> bool:
    """Whether `conn` speaks TLS (Connection.channel's rule)."""
    return conn.tls or conn.ca is not None or conn.cert is not None


def _model_shape(vocab_size: Any, max_tokens: Any, source: str, names: tuple[str, str]) -> tuple[int, int]:
    """The model's shape as the ids users draw from it, or the failed call its answer is: a vocabulary size
    that is not a whole number of at least 2 (ids are drawn from 1 up), or a most tokens per input under 1,
    once raised in that draw, out of the task, and no request was recorded. `names`: the two fields as the
    answer names them, so that the message names the one at fault."""
    wrong = [
        f"{name} {value!r}, where a whole number of at least {least} was expected"
        for name, value, least in zip(names, (vocab_size, max_tokens), (2, 1), strict=True)
        if not isinstance(value, int) or isinstance(value, bool) or value < least
    ]
    if wrong:
        raise CallError("BAD_RESPONSE", f"{source}: {'; '.join(wrong)}")
    return vocab_size, max_tokens


class GrpcClient:
    """encoder.v1 over one channel per user, its calls with the connection's metadata (the API key)."""

    request_type = "Encode"
    info_type = "GetModelInfo"

    def __init__(self, host: str, timeout: float, conn: Connection | None = None) -> None:
        conn = conn or Connection()
        # A host without a port gets the server's, as `mhaserve encode` takes an address (grpc's would be 443),
        # but for a TLS URL (https://gateway: 443).
        tls_url = host.startswith(("grpcs://", "https://"))
        for scheme in ("grpcs://", "https://", "grpc://", "http://", "dns:///"):
            host = host.removeprefix(scheme)
        host = host.rstrip("/")
        self.channel = conn.channel(host if tls_url else with_default_port(host), CHANNEL_OPTIONS)
        self.metadata = conn.metadata()
        self.stub = pb_grpc.EncoderServiceStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def model_shape(self, model: str) -> tuple[int, int]:
        """(vocabulary size, most tokens per input) of the model."""
        try:
            info = self.stub.GetModelInfo(
                pb.GetModelInfoRequest(model=model), timeout=self.timeout, metadata=self.metadata
            )
        except grpc.RpcError as e:
            raise CallError.from_rpc(e) from None
        names = ("vocab_size", "max_tokens_per_input")
        return _model_shape(info.vocab_size, info.max_tokens_per_input, "GetModelInfo", names)

    def _call(self, request: pb.EncodeRequest) -> Answer:
        try:
            response = self.stub.Encode(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            raise CallError.from_rpc(e) from None
        return response.ByteSize(), len(response.embeddings)

    def encode(self, model: str, texts: list[str] | None = None, ids: list[list[int]] | None = None) -> Answer:
        if ids is not None:
            return self._call(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=s) for s in ids], model=model, truncate=True))
        return self._call(pb.EncodeRequest(texts=texts, model=model, truncate=True))

    def bad(self, model: str, text: str) -> Answer:
        """Texts and token ids both set: INVALID_ARGUMENT each time."""
        return self._call(pb.EncodeRequest(texts=[text], token_ids=[pb.TokenIds(ids=[1, 2])], model=model))


class HttpClient:
    """OpenAI `POST /v1/embeddings` over one keep-alive connection per user (HTTPS with the connection's TLS),
    the API key in its Authorization header."""

    request_type = "POST"
    info_type = "GET"

    def __init__(self, host: str, timeout: float, encoding_format: str, conn: Connection | None = None) -> None:
        conn = conn or Connection()
        url = host if "://" in host else f"{'https' if uses_tls(conn) else 'http'}://{host}"
        tls: dict[str, Any] = {}
        if url.startswith("https://"):
            # Verified against --tls-ca, or the system's CA certificates; the client certificate for mutual TLS.
            options = {"ca_certs": str(conn.ca)} if conn.ca is not None else {}
            if conn.cert is not None and conn.key is not None:
                options |= {"certfile": str(conn.cert), "keyfile": str(conn.key)}
            tls = {"ssl_options": options}
        self.client = HTTPClient.from_url(
            url, concurrency=1, connection_timeout=timeout, network_timeout=timeout, **tls
        )
        self.timeout = timeout
        self.encoding_format = encoding_format
        # The same `authorization: Bearer KEY` as the gRPC metadata: HTTP header names are case-insensitive.
        self.headers = {"Content-Type": "application/json", **dict(conn.metadata() or ())}

    def close(self) -> None:
        self.client.close()

    def _request(self, method: str, path: str, body: bytes = b"") -> bytes:
        try:
            response = self.client.request(method, path, body=body, headers=self.headers)
            content = bytes(response.read())
        except TimeoutError:  # connecting or the answer: as a gRPC deadline, not a connection to back off from
            raise CallError("TIMEOUT", f"no answer within --rpc-timeout {self.timeout:g} s") from None
        except (OSError, HTTPException) as e:  # refused, reset, cut short, a failed TLS handshake: no answer
            raise CallError("CONNECTION", f"{type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise CallError.from_http(response.status_code, content)
        return content

    def model_shape(self, model: str) -> tuple[int, int]:
        content = self._request("GET", "/info")
        info = _json(content, "GET /info: ")
        # Each shape of answer it cannot read is named for what is missing: one message about the shape once
        # stood for a served model without its version, or a body without the list of models.
        if not isinstance(info, dict):
            raise CallError("BAD_RESPONSE", f"GET /info: a 200 whose JSON is no object: {_start(content)}")
        served: dict[str, Any] = info
        whose = "the model"
        if model:
            models = info.get("models")
            if not isinstance(models, list):
                raise CallError(
                    "BAD_RESPONSE",
                    f"GET /info: a 200 without the list of served models ('models') that --model {model} is looked "
                    f"for in: {_start(content)}",
                )
            found = next((m for m in models if model in _served_names(m)), None)
            if found is None:  # once the default model's shape, silently
                raise CallError("HTTP 404", f"model {model!r} is not among the served models (GET /info)")
            served, whose = found, f"model {model!r}"
        keys = ("vocab_size", "max_input_length")
        if missing := [k for k in keys if k not in served]:  # a KeyError once escaped the task
            raise CallError(
                "BAD_RESPONSE", f"GET /info: a 200 without {' and '.join(missing)} for {whose}: {_start(content)}"
            )
        return _model_shape(served["vocab_size"], served["max_input_length"], "GET /info", keys)

    def _call(self, body: dict[str, Any]) -> Answer:
        content = self._request("POST", ROUTE, orjson.dumps(body))
        return len(content), len(_answer(content, lambda a: a["data"]))

    def encode(self, model: str, texts: list[str] | None = None, ids: list[list[int]] | None = None) -> Answer:
        body: dict[str, Any] = {"input": ids if ids is not None else texts, "encoding_format": self.encoding_format}
        body["truncate"] = True
        if model:
            body["model"] = model
        return self._call(body)

    def bad(self, model: str, text: str) -> Answer:
        """An empty string among the inputs: 400 each time."""
        return self._call({"input": [text, ""], **({"model": model} if model else {})})


def _served_names(entry: Any) -> tuple[str, str]:
    """The names --model may give a served model of GET /info by: `name` and `name:version`; or the failed
    call an entry without them is."""
    if not isinstance(entry, dict):
        raise CallError(
            "BAD_RESPONSE", f"GET /info: a 200 whose served model is no object: {_start(orjson.dumps(entry))}"
        )
    for key in ("model", "version"):
        if key not in entry:
            raise CallError(
                "BAD_RESPONSE", f"GET /info: a 200 whose served model has no {key!r}: {_start(orjson.dumps(entry))}"
            )
    return entry["model"], f"{entry['model']}:{entry['version']}"


def _start(content: bytes) -> str:
    """The start of a body, for a failure's message."""
    return content[:100].decode("utf-8", "replace") or "(empty)"


def _json(content: bytes, source: str = "") -> Any:
    """A 200's body read as JSON, or the failed call it is, told apart from JSON of another shape: a proxy's
    page, or a body cut short, is no answer of any server that speaks the protocol."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        raise CallError("BAD_RESPONSE", f"{source}a 200 whose body is not JSON: {_start(content)}") from None


def _answer(content: bytes, vectors: Callable[[Any], Any]) -> list[Any]:
    """The list of embeddings in a 200's body, or the failed call it is: a proxy's page or a cut body once
    escaped the task as an exception, and no request was recorded."""
    answer = _json(content)
    try:
        found = vectors(answer)
    except (KeyError, TypeError, IndexError):
        found = None
    if not isinstance(found, list):
        raise CallError("BAD_RESPONSE", f"a 200 without the embeddings: {_start(content)}")
    return found


class TeiClient(HttpClient):
    """text-embeddings-inference's `POST /embed` (TEI's body and its answer, a list of vectors), as HttpClient
    reaches the server; `model`, an extension of this server's, only when one is asked for."""

    def _call(self, body: dict[str, Any]) -> Answer:
        content = self._request("POST", TEI_ROUTE, orjson.dumps(body))
        return len(content), len(_answer(content, lambda a: a))

    def encode(self, model: str, texts: list[str] | None = None, ids: list[list[int]] | None = None) -> Answer:
        body: dict[str, Any] = {"inputs": ids if ids is not None else texts, "truncate": True}
        if model:
            body["model"] = model
        return self._call(body)

    def bad(self, model: str, text: str) -> Answer:
        """An empty string among the inputs: 400 each time."""
        return self._call({"inputs": [text, ""], **({"model": model} if model else {})})


def workload_names(workload: str, protocol: str) -> list[str]:
    """The task sets --workload names, or ValueError saying what is wrong with it."""
    names = [w.strip() for w in workload.split(",") if w.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or not names:
        raise ValueError(f"--workload {workload!r}: unknown {unknown}; choose from {', '.join(WORKLOADS)}")
    if protocol in HTTP_PROTOCOLS and GRPC_ONLY & set(names):
        raise ValueError(f"--workload {', '.join(sorted(GRPC_ONLY & set(names)))} is gRPC only")
    return names


class EncoderUser(User):
    """One client of encoder.v1 (or of the OpenAI route, with --protocol http) with its own connection; its
    task set comes from --workload."""

    host = DEFAULT_HOST
    # The slowest call recorded in this process in this run, answered or failed: what a call still in flight
    # when the run ends is measured against (_in_flight). Set back to 0 when a run starts (_new_run).
    slowest_s: ClassVar[float] = 0.0

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.client: GrpcClient | HttpClient | None = None
        self.workloads: list[Callable[[], None]] = []
        self.backoff = 0.0

    def wait_time(self) -> float:
        opts = self.environment.parsed_options
        think = getattr(opts, "think_time", 0.0) if opts else 0.0
        pause, self.backoff = self.backoff, 0.0
        return max(pause, random.uniform(0, think) if think > 0 else 0.0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.opt: dict[str, Any] = {
            "protocol": "grpc",
            "workload": "mixed",
            "batch_size": 8,
            "stream_requests": 8,
            "corpus": "",
            "short_corpus": "",
            "tokenizer": "",
            "model": "",
            "encoding_format": "float",
            "rpc_timeout": 30.0,
            "api_key": "",
            "tls": False,
            "tls_ca": "",
            "tls_client_cert": "",
            "tls_client_key": "",
        }
        if opts is not None:
            self.opt.update({k: getattr(opts, k) for k in self.opt if getattr(opts, k, None) is not None})
        names = workload_names(str(self.opt["workload"]), str(self.opt["protocol"]))
        host = self.host or DEFAULT_HOST
        if self.opt["protocol"] in HTTP_PROTOCOLS:
            if host == DEFAULT_HOST:  # no -H: the server's HTTP port, not its gRPC one (HTTPS with TLS)
                host = DEFAULT_HTTP_HOST.removeprefix("http://")
            conn = connection(self.opt, host)
            kind = HttpClient if self.opt["protocol"] == "http" else TeiClient
            self.client = kind(host, self.opt["rpc_timeout"], self.opt["encoding_format"], conn)
        else:
            self.client = GrpcClient(host, self.opt["rpc_timeout"], connection(self.opt, host))
        self.corpus = Corpus.load(str(self.opt["corpus"] or DEFAULT_CORPUS))
        if "short" in names:
            self.short = Corpus.load(str(self.opt["short_corpus"] or DEFAULT_SHORT_CORPUS)).all
        self.workloads = [getattr(self, f"task_{n}") for n in names]
        # The ids task's inputs need the model's shape: asked for by that task's first call, not here, since
        # a user whose start failed (the server not up yet, an unknown --model) died, and the run idled.
        self.ids: list[list[int]] | None = None

    def on_stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def _load_ids(self, vocab: int, max_tokens: int) -> list[list[int]]:
        key = (self.opt["corpus"], self.opt["tokenizer"], vocab, max_tokens)
        if key not in _ids_cache:
            _ids_cache[key] = _token_ids(self.corpus, self.opt["tokenizer"], vocab, max_tokens)
        return _ids_cache[key]

    @task
    def work(self) -> None:
        random.choice(self.workloads)()

    # ---- reporting ----------------------------------------------------------------------------------

    def _fire(self, rpc: str, name: str, started: float, length: int, error: Exception | None) -> None:
        if isinstance(error, CallError) and error.code in BACKOFF_CODES:
            self.backoff = BACKOFF_S
        if isinstance(error, CallError) and error.code in CREDENTIALS_REFUSED:
            _credentials_refused(self.environment, error)
            self.backoff = BACKOFF_S  # until the run's end reaches this user
        elapsed = time.perf_counter() - started
        if not (isinstance(error, CallError) and error.code == IN_FLIGHT):  # the bound of the other users' too
            EncoderUser.slowest_s = max(EncoderUser.slowest_s, elapsed)
        self.environment.events.request.fire(
            request_type=rpc,
            name=name,
            response_time=elapsed * 1000,
            response_length=length,
            exception=error,
            context={},
        )

    @contextmanager
    def _in_flight(self, rpc: str, name: str, sent: deque[float]) -> Iterator[None]:
        """Around a call, `sent` the send times of its requests not yet answered (one, but for a stream).

        Locust ends a run by killing its users (GreenletExit) in whatever call they wait on, and such a call
        was never recorded: a server stopped 7 s before the end of a 10 s run passed with no failure, as did
        one that hung for the last 29 s of `make loadtest`'s minute. Every run ends with calls in flight,
        though, most of them sent a moment before: a call cut off is recorded as an IN_FLIGHT failure (its
        response time, how long it had waited) only once it has waited longer than twice the slowest call
        of the run, and 1 s: the server answered every other call in half that time, so this one was most
        likely not coming. The last calls of a healthy run, however slow its calls, have waited about as
        long as the others did, and are left out, as before, so it does not fail on them."""
        try:
            yield
        except GreenletExit:
            now = time.perf_counter()
            bound = max(IN_FLIGHT_MIN_S, 2 * EncoderUser.slowest_s)
            error = CallError(
                IN_FLIGHT, "no answer when the run ended, after waiting over twice the run's slowest call"
            )
            for started in [t for t in sent if now - t > bound]:
                self._fire(rpc, name, started, 0, error)
            raise

    def _encode(self, name: str, texts: list[str] | None = None, ids: list[list[int]] | None = None) -> None:
        assert self.client is not None
        started = time.perf_counter()
        try:
            with self._in_flight(self.client.request_type, name, deque([started])):
                length, received = self.client.encode(self.opt["model"], texts=texts, ids=ids)
        except CallError as e:
            self._fire(self.client.request_type, name, started, 0, e)
            return
        n = len(ids) if ids is not None else len(texts or [])
        error = None if received == n else CallError("BAD_RESPONSE", f"{received} embeddings for {n} inputs")
        self._fire(self.client.request_type, name, started, length, error)

    # ---- the task sets --------------------------------------------------------------------------------

    def task_short(self) -> None:
        """One text of the short-text corpus (queries, sentences, some paragraphs; median about 20 tokens):
        the traffic most users send, where the work around the model weighs most."""
        self._encode("short", texts=[random.choice(self.short)])

    def task_query(self) -> None:
        """One query of corpus.txt (up to 8 words): the shortest requests."""
        self._encode("query", texts=[random.choice(self.corpus.queries)])

    def task_long(self) -> None:
        """One paragraph per request (truncated at the model's maximum): the model dominates."""
        self._encode("long", texts=[random.choice(self.corpus.long)])

    def task_mixed(self) -> None:
        """One text drawn from the whole corpus: mostly short, a long tail, as real traffic."""
        self._encode("mixed", texts=[random.choice(self.corpus.all)])

    def task_batch(self) -> None:
        """N texts in one request, as an indexing job sends them."""
        n = int(self.opt["batch_size"])
        self._encode(f"batch{n}", texts=random.choices(self.corpus.all, k=n))

    def task_ids(self) -> None:
        """One pre-tokenised input: no tokenisation on the server."""
        if self.ids is None:
            assert self.client is not None
            vocab, max_tokens = 30522, 256  # with --tokenizer: its ids, and no call for the model's shape
            if not self.opt["tokenizer"]:
                started = time.perf_counter()
                try:
                    with self._in_flight(self.client.info_type, "model info", deque([started])):
                        vocab, max_tokens = self.client.model_shape(self.opt["model"])
                except CallError as e:  # recorded as the failed call it is, and asked again after the back-off
                    self._fire(self.client.info_type, "model info", started, 0, e)
                    return
                self._fire(self.client.info_type, "model info", started, 0, None)  # a call as any other
            self.ids = self._load_ids(vocab, max_tokens)
        self._encode("ids", ids=[random.choice(self.ids)])

    def task_bad(self) -> None:
        """A request the server must refuse: INVALID_ARGUMENT (gRPC) or 400 (HTTP) each time."""
        assert self.client is not None
        started = time.perf_counter()
        try:
            with self._in_flight(self.client.request_type, "bad", deque([started])):
                length, _ = self.client.bad(self.opt["model"], random.choice(self.corpus.queries))
        except CallError as e:
            self._fire(self.client.request_type, "bad", started, 0, e)
            return
        self._fire(
            self.client.request_type, "bad", started, length, CallError("ACCEPTED", "a bad request got an answer")
        )

    def task_stream(self) -> None:
        """Several requests pipelined on one EncodeStream; each response is one Locust request."""
        assert isinstance(self.client, GrpcClient)
        n = int(self.opt["stream_requests"])
        sent: deque[float] = deque()
        model = self.opt["model"]

        def requests() -> Iterator[pb.EncodeRequest]:
            for _ in range(n):
                sent.append(time.perf_counter())
                yield pb.EncodeRequest(texts=[random.choice(self.corpus.all)], model=model, truncate=True)

        started = time.perf_counter()
        received = 0
        with self._in_flight("EncodeStream", "stream", sent):
            try:
                stream = self.client.stub.EncodeStream(
                    requests(), timeout=self.opt["rpc_timeout"], metadata=self.client.metadata
                )
                for response in stream:
                    t0 = sent.popleft() if sent else started
                    received += 1
                    error = None
                    if response.HasField("error"):
                        code = STATUS_NAMES.get(response.error.code, f"STATUS_{response.error.code}")
                        error = CallError(code, response.error.message)
                    self._fire("EncodeStream", "stream", t0, response.ByteSize(), error)
            except grpc.RpcError as e:
                # The stream itself failed: the requests without a response fail with its status.
                failure = CallError.from_rpc(e)
                for _ in range(n - received):
                    self._fire("EncodeStream", "stream", sent.popleft() if sent else started, 0, failure)


class _Run:
    """What this process knows of the run in progress, reset as each starts (the web UI runs several)."""

    refusal_named = False  # on a master: a worker's refusal logged (_refused), one line however many refuse
    credentials_refused = False  # in this process: the server refused the credentials (_credentials_refused)


@events.test_start.add_listener
def _new_run(**_: Any) -> None:
    EncoderUser.slowest_s = 0.0
    _Run.refusal_named = _Run.credentials_refused = False


@events.init.add_listener
def _clock(**_: Any) -> None:
    """Bring the event loop's clock up to date before Locust starts its --run-time timer.

    gevent's loop reads the clock once per iteration, and importing this file (grpc, its gevent
    integration) blocks the loop for a while before the first one: without this, the timer counts from
    a moment up to seconds in the past, and a short run (the tests' 2 s, on a busy machine) ends before
    it has made a request."""
    import gevent

    gevent.get_hub().loop.update_now()


def _forked_by_a_master() -> bool:
    """Whether this process is a worker that `--processes` forked for the master it was forked from (not for a
    `--worker --processes N` parent, whose workers serve a master elsewhere and stop on Ctrl-C themselves, that
    parent waiting for them). Locust makes every fork a worker; whether its parent was one, the command line,
    the environment or a config file said: read again as Locust read them (a look at the command line alone
    missed LOCUST_MODE_WORKER=yes and locust.conf's `worker = true`, and such workers ignored Ctrl-C)."""
    if os.getpid() == LOADED_BY:
        return False
    from locust.argument_parser import get_parser

    try:
        return not get_parser().parse_args().worker
    except SystemExit:  # (the parent read them without an error)
        return False


@events.init.add_listener
def _ctrl_c_on_the_hub(**_: Any) -> None:
    """Read Ctrl-C (SIGINT) as Locust reads SIGTERM, by a signal watcher on gevent's hub, and raise
    KeyboardInterrupt in the main greenlet from there, as Python's own handler would (Locust then ends the run).

    Once, a Ctrl-C sent while the server hung was never acted on: the run went on to its --run-time and exited
    0, and nothing of the KeyboardInterrupt was seen, not even gevent's report of it (1 run of about 80; not
    caught again under instrumentation in 65 more). Python's handler only flags the signal, to be raised
    wherever the main thread next runs Python code; SIGTERM's watcher, on the hub, never missed one. Not where
    SIGINT is ignored (a run started in the background): a watcher would take it."""
    import gevent

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    if _forked_by_a_master():
        # A terminal's Ctrl-C reaches the whole group: such a worker stopped at once, before the calls its users
        # waited on reached the master as IN_FLIGHT failures, and the run exited 0. Its master stops it instead,
        # with those figures, as it does on SIGTERM. The first only, as Locust's own worker parent ignores it: a
        # second (pressed again, a master gone, Locust's own end of the run) stops it.
        def first_ignored(*_: Any) -> None:
            signal.signal(signal.SIGINT, signal.default_int_handler)

        signal.signal(signal.SIGINT, first_ignored)
        return
    hub = gevent.get_hub()
    gevent.signal_handler(signal.SIGINT, lambda: hub.parent.throw(KeyboardInterrupt))


@events.init.add_listener
def _check_options(environment: Any, **_: Any) -> None:
    """Refuse bad options before the run, as argparse refuses a bad option (exit 2): checked only in each
    user's start, they failed there and the run then idled for its whole --run-time, blaming the server."""
    if environment.parsed_options is None:
        return
    if problems := _option_problems(environment):
        log.error("%s", problems)
        _end_forked_workers()
        sys.exit(REFUSED_EXIT)


def _option_problems(environment: Any) -> str:
    """What is wrong with the options, as one message; empty when nothing is."""
    opts = environment.parsed_options
    try:
        names = workload_names(str(getattr(opts, "workload", "mixed")), str(getattr(opts, "protocol", "grpc")))
    except ValueError as e:
        return str(e)
    problems = [
        f"--{name.replace('_', '-')} must be {bound}, got {getattr(opts, name)}"
        for name, ok, bound in (
            ("batch_size", lambda v: v >= 1, ">= 1"),
            ("stream_requests", lambda v: v >= 1, ">= 1"),
            # as `mhaserve encode` bounds its --timeout: grpcio failed every call at once at 1e10 s
            ("rpc_timeout", lambda v: 0 < v <= MAX_TIMEOUT_S, f"> 0 and at most {MAX_TIMEOUT_S} (seconds)"),
            ("think_time", lambda v: 0 <= v <= MAX_TIMEOUT_S, f">= 0 and at most {MAX_TIMEOUT_S} (seconds)"),
            ("max_fail_ratio", lambda v: 0 <= v <= 1, "a fraction in [0, 1]"),
        )
        if getattr(opts, name, None) is not None and not ok(getattr(opts, name))
    ]
    if _reads_files_here(environment):
        problems += _file_problems(opts, names)
    problems += _security_problems(environment, opts)
    return "; ".join(problems)


@events.test_start.add_listener
def _check_the_masters_options(environment: Any, **_: Any) -> None:
    """On a worker of a separate master, check the options again as the run starts, and refuse it there: the
    master's options reach a worker only now, with the run's start (at init it checked its own command line),
    and the master checked no files (its paths may not be its workers'). Its users failed in their start, the
    run idled through its whole --run-time, and the master blamed the server before it named the file."""
    import gevent
    from locust.runners import WorkerRunner

    runner = environment.runner
    if not isinstance(runner, WorkerRunner) or environment.parsed_options is None:
        return
    if problems := _option_problems(environment):
        log.error("%s", problems)
        runner.send_message(REFUSED, {"problems": problems})
        environment.process_exit_code = REFUSED_EXIT
        # Not from here: this is the runner's own message loop, which quit() kills. Spawned now, the quit runs
        # before the users this run's start spawns next (and kills their spawner), so none fails in its start.
        gevent.spawn(runner.quit)


@events.init.add_listener
def _hear_refusals(environment: Any, **_: Any) -> None:
    """On a master, hear its workers' refusals (_check_the_masters_options)."""
    from locust.runners import MasterRunner

    if isinstance(environment.runner, MasterRunner):
        # concurrent: _refused quits the runner, whose message loop would otherwise call it
        environment.runner.register_message(REFUSED, _refused, concurrent=True)


def _credentials_refused(environment: Any, error: CallError) -> None:
    """The server refused a call's credentials: end the run as a refused option ends it (exit 2, named once),
    where its users went on refusing for the whole --run-time, each sending its next call the moment the last
    was refused, and the run measured nothing. A worker tells its master, which ends the run for all."""
    import gevent
    from locust.runners import WorkerRunner

    if _Run.credentials_refused:
        return  # another call's, in this process
    _Run.credentials_refused = True
    problems = (
        f"the server refused this run's credentials ({error!r}): every call would be refused the same, so the run "
        "stops; give the server's API key with --api-key or $MHASERVE_API_KEY"
    )
    runner = environment.runner
    if isinstance(runner, WorkerRunner):
        runner.send_message(REFUSED, {"problems": problems})
    else:
        # Not from this user's greenlet, which quitting the runner kills.
        gevent.spawn(_end_refused, environment, problems)


def _refused(environment: Any, msg: Any, **_: Any) -> None:
    """A worker refused the run's options, or the server its credentials: end it as a refused option ends a run
    elsewhere (exit 2, the problem named once, however many workers refuse), not after its --run-time."""
    if _Run.refusal_named:
        return  # another worker's
    _Run.refusal_named = True
    _end_refused(environment, msg.data["problems"])


def _end_refused(environment: Any, problems: str) -> None:
    """End a refused run (exit 2, the problem logged). With the web UI (and no --autostart), the run stops and
    the UI stays up, its log naming the problem, for a later run (with workers started again after a refusal
    of theirs)."""
    log.error("%s", problems)
    opts = environment.parsed_options
    # --autostart: the web UI beside a run nobody starts by hand, which ran on to its --run-time
    if opts is not None and (getattr(opts, "headless", False) or getattr(opts, "autostart", False)):
        environment.process_exit_code = REFUSED_EXIT
        environment.runner.quit()
        if environment.web_ui is not None:  # what the process waits on with --autostart
            environment.web_ui.stop()
    else:
        environment.runner.stop()


def _end_forked_workers() -> None:
    """End this process's children, which on a master of `--processes` are the workers it forked, and wait
    (3 s at most) until each has exited. A worker connects to its master before it reads the options (and
    refuses them as its master does): one slower than its master, on a busy machine, was still waiting for an
    answer after the master exited, and waited on for five minutes, logging that it could not connect. Locust's
    own end of the run signals only the workers that have exited already. Elsewhere this process has no
    children: users make none. Not reaped here, so that Locust's end of the run still collects them."""
    # --processes forks on Linux and macOS; only Linux's /proc is read here, and only where it is this process's
    # own (in a sandbox that did not mount its own, its pids would name other processes)
    if not Path("/proc/self").is_dir() or os.readlink("/proc/self") != str(os.getpid()):
        return
    children = [pid for pid, parent, _ in _processes() if parent == os.getpid()]
    for pid in children:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)  # not SIGINT: a run started in the background ignores it, forks too
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and _alive(children):
        time.sleep(0.05)  # gevent's: Locust patched the standard library
    for pid in _alive(children):  # one already in Locust's own SIGTERM handler, still winding down
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running (neither gone nor a zombie): their own entries of /proc, not all of it."""
    return [pid for pid in pids if (got := _stat(Path(f"/proc/{pid}/stat"))) is not None and got[1] != "Z"]


def _processes() -> Iterator[tuple[int, int, str]]:
    """(pid, parent's pid, state) of each process, from /proc."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        if (got := _stat(stat)) is not None:
            yield int(stat.parent.name), got[0], got[1]


def _stat(stat: Path) -> tuple[int, str] | None:
    """(parent's pid, state) from a /proc/<pid>/stat file; None once that process is gone."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    # the command name, in parentheses, may hold anything: the fields after the last ")" are fixed
    state, parent = text[text.rindex(")") + 2 :].split()[:2]
    return int(parent), state


def _reads_files_here(environment: Any) -> bool:
    """Whether the users read their files (corpora, tokenizer, certificates) on this machine: in a local run
    and on a worker, and on a master of `--processes`, whose workers are its own forks; not on another master,
    whose paths may not be its workers'. A master of `--processes` once checked none, and idled through its
    whole run-time while its forked workers refused a file and exited."""
    from locust.runners import MasterRunner

    opts = environment.parsed_options
    return not isinstance(environment.runner, MasterRunner) or bool(getattr(opts, "processes", None))


def _not_a_file(flag: str, path: str) -> str:
    """Why `path`, given to `flag`, is not a file to read, or "": a directory was said to be no such file."""
    if Path(path).is_dir():
        return f"{flag} {path} is a directory: give a file"
    return "" if Path(path).is_file() else f"{flag} {path}: no such file"


def _file_problems(opts: Any, names: list[str]) -> list[str]:
    """What is wrong with the corpora and the tokenizer, each read as the users will read it: a file that
    exists but holds no text, or no tokenizer, failed only in each user (in its start, or in every task)."""
    problems = []
    corpora = [("corpus", DEFAULT_CORPUS, True), ("short_corpus", DEFAULT_SHORT_CORPUS, "short" in names)]
    for name, default, used in corpora:
        given = getattr(opts, name, "") or ""
        if not given and not used:
            continue
        path, flag = given or str(default), f"--{name.replace('_', '-')}"
        if missing := _not_a_file(flag, path):
            problems.append(missing)
            continue
        try:
            Corpus.load(path)  # kept: the users of this process find it loaded
        except UnicodeDecodeError as e:  # a ValueError too: first
            problems.append(f"{flag} {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})")
        except ValueError:
            problems.append(f"{flag} {path} holds no text (it is empty, or blank lines only)")
        except OSError as e:
            problems.append(f"{flag} {path} cannot be read ({_reason(e)})")
    if tokenizer := getattr(opts, "tokenizer", "") or "":
        if missing := _not_a_file("--tokenizer", tokenizer):
            problems.append(missing)
        else:
            from tokenizers import Tokenizer

            try:
                Tokenizer.from_file(tokenizer)
            except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
                problems.append(f"--tokenizer {tokenizer} is no tokenizer.json ({str(e)[:200]})")
    return problems


def _security_problems(environment: Any, opts: Any) -> list[str]:
    """What is wrong with the key and TLS options; no message shows the key."""
    problems = []
    key = getattr(opts, "api_key", "") or ""
    # What the server takes, as `mhaserve encode` checks it: grpc core refused another as "Invalid metadata".
    if key and (not key.isascii() or not key.isprintable() or " " in key):
        problems.append(f"--api-key (or ${API_KEY_ENV}): an API key is printable ASCII without spaces")
    files = {name: getattr(opts, name, "") or "" for name, _ in TLS_FILES}
    tls = bool(getattr(opts, "tls", False)) or any(files.values())
    if bool(files["tls_client_cert"]) != bool(files["tls_client_key"]):
        problems.append("--tls-client-cert and --tls-client-key go together (the client certificate and its key)")
    host = environment.host or ""
    if tls and getattr(opts, "protocol", "grpc") in HTTP_PROTOCOLS and host.startswith("http://"):
        problems.append(f"-H {host} is plaintext HTTP, but the TLS options ask for TLS: give https://")
    if problems or not _reads_files_here(environment):
        return problems
    missing = [m for name, flag in TLS_FILES if files[name] and (m := _not_a_file(flag, files[name]))]
    if missing:
        return missing
    # Read as the users will, so that a file that is no PEM certificate or key is named now, not in each call.
    context = ssl.create_default_context()
    try:
        if files["tls_ca"]:
            context.load_verify_locations(cafile=files["tls_ca"])
    except OSError as e:  # ssl.SSLError among them
        return [f"--tls-ca {files['tls_ca']} holds no usable PEM certificate ({_reason(e)})"]
    try:
        if files["tls_client_cert"]:
            context.load_cert_chain(files["tls_client_cert"], files["tls_client_key"], password=lambda: b"")
    except OSError as e:  # ssl.SSLError among them
        return [
            f"--tls-client-cert {files['tls_client_cert']} and --tls-client-key {files['tls_client_key']} "
            f"are no PEM certificate and its unencrypted key ({_reason(e)})"
        ]
    return []


def _reason(e: OSError) -> str:
    return str(getattr(e, "reason", None) or e.strerror or e)


@events.quitting.add_listener
def _exit_code(environment: Any, **_: Any) -> None:
    """Exit 1 past the failure threshold (Locust's default fails the run on a single failure), and whatever
    the ratio when the figures leave part of the run out: no requests at all, tasks that raised exceptions
    (no request was recorded for them), calls the server left unanswered at the end."""
    from locust.runners import WorkerRunner

    if isinstance(environment.runner, WorkerRunner):
        return  # the master decides, on the aggregated stats
    if environment.process_exit_code == REFUSED_EXIT:
        return  # refused (_end_refused): the options, or the server the credentials; no figures to judge
    opts = environment.parsed_options
    _stop_users(environment, opts)
    if opts is not None and getattr(opts, "json_file", None):
        # Locust skips its closing summary when it writes --json-file; `make loadtest` wants both.
        from locust.stats import print_error_report, print_percentile_stats, print_stats

        print_stats(environment.stats, current=False)
        print_percentile_stats(environment.stats)
        print_error_report(environment.stats)
    threshold = getattr(opts, "max_fail_ratio", 0.01) if opts else 0.01
    total = environment.stats.total
    failed = []
    if total.num_requests == 0:
        failed.append(f"no requests were made: is the server at {environment.host} up?")
    elif total.fail_ratio > threshold:
        failed.append(f"{total.fail_ratio:.2%} of requests failed, more than the allowed {threshold:.2%}")
    rows = list(environment.runner.exceptions.values()) if environment.runner is not None else []
    if raised := sum(row["count"] for row in rows):
        # The first one's message (or, for one without, the line that raised it); each with its traceback in
        # the log and in --csv's stats_exceptions.csv.
        first = rows[0]["msg"] or (rows[0]["traceback"].strip().splitlines() or ["?"])[-1].strip()
        others = f", and {len(rows) - 1} other kinds" if len(rows) > 1 else ""
        failed.append(
            f"the users raised {raised} exception{'s' if raised != 1 else ''} ({first}{others}): "
            "a task that raises makes no request, so the figures leave it out"
        )
    if unanswered := _unanswered(environment.stats):
        # Whatever the ratio: a server that stopped answering leaves one such call per user however long it
        # has hung (29 s of a 60 s run), a fraction of the requests that no threshold would notice.
        failed.append(
            f"{unanswered} call{'s' if unanswered != 1 else ''} had no answer when the run ended, in flight for "
            f"longer than twice the run's slowest call ({IN_FLIGHT} failures): the server stopped answering"
        )
    for message in failed:
        log.error("%s", message)
    environment.process_exit_code = 1 if failed else 0


def _stop_users(environment: Any, opts: Any) -> None:
    """Stop the run's users, if a signal (SIGTERM, Ctrl-C) ended the run rather than --run-time: Locust
    decides the exit status, here, before it stops them, and the calls they wait on become IN_FLIGHT failures
    only as they stop (EncoderUser._in_flight), so a run stopped by a signal while the server hung exited 0.
    With --csv, the figures are then written once more: Locust writes the CSV once a second and not at exit, so
    it left out the run's last second, those failures with it."""
    import gevent
    from locust.runners import STATE_RUNNING, STATE_SPAWNING
    from locust.stats import CSV_STATS_INTERVAL_SEC

    runner = environment.runner  # a local one, or --processes' master, which waits for its workers' figures
    if runner is not None and runner.state in (STATE_SPAWNING, STATE_RUNNING):
        runner.stop()
    if opts is not None and getattr(opts, "csv_prefix", None):
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.2)  # the writer's next turn, on the final figures


def _unanswered(stats: Any) -> int:
    """How many IN_FLIGHT failures the stats hold (a local run's errors are CallErrors, a master's their
    repr)."""
    from locust.stats import StatsError

    return sum(
        e.occurrences for e in stats.errors.values() if StatsError.parse_error(e.error).startswith(f"{IN_FLIGHT}:")
    )
