"""The locustfile, headless against a real server over gRPC and over HTTP: successes recorded, and failures
by gRPC status or HTTP status; against servers with API keys, TLS and mutual TLS."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest

from mhaserve.loadtest.bench.client import Server
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.settings import ApiKeys
from mhaserve.testing.loopback import free_port, free_ports, wait_until
from mhaserve.testing.server import ServerThread, local_settings
from tests.loadtest.conftest import bench_server
from tests.security import conftest as security
from tests.security.conftest import Pki

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"

IN_FLIGHT_ERROR = "IN_FLIGHT"  # the failure the locustfile records for a call the run's end cut off
KEY = "k-locust-7f3a9c"  # the keyed servers' API key
# What would reach the locustfile from the environment of whoever runs the tests.
OWN_SETTINGS = ("MHASERVE_API_KEY", "LOCUST_TLS", "LOCUST_TLS_CA", "LOCUST_TLS_CLIENT_CERT", "LOCUST_TLS_CLIENT_KEY")

pytestmark = pytest.mark.slow

# The security tests' certificates (a CA, a server's for 127.0.0.1, a client's), made once per session.
pki = security.pki


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in OWN_SETTINGS} | extra


def _own_master(cmd: list[str]) -> list[str]:
    """`cmd` with a master port of its own where it forks workers (`--processes`): Locust's default, 5557,
    is shared by every run on the machine, so two at once (another checkout's suite, a load test) met."""
    if "--processes" not in cmd or "--master-port" in cmd:
        return cmd
    port = str(free_port())
    return [*cmd, "--master-port", port, "--master-bind-port", port]


def _locust(
    server: Server | ServerThread,
    out: Path,
    workload: str,
    *extra: str,
    protocol: str = "grpc",
    host: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    host = host or (server.http_url if protocol in ("http", "tei") else server.address)
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--protocol", protocol,
        "-H", host, "-u", "4", "-r", "4", "-t", "2s", "--only-summary",
        "--workload", workload, "--csv", str(out / "stats"), "--json-file", str(out / "stats"),
        *extra,
    ]  # fmt: skip
    return subprocess.run(_own_master(cmd), capture_output=True, text=True, timeout=60, cwd=ROOT, env=env or _env())


def _worker(port: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A Locust worker of its own, for the master on `port` of this machine."""
    return subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker", "--master-host", "127.0.0.1",
         "--master-port", port],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env or _env(),
    )  # fmt: skip


def _entries(out: Path) -> dict[str, dict[str, Any]]:
    """The run's final figures by task name, from stats.json, which Locust writes at exit. Not from the
    CSV: Locust rewrites it once a second and not at exit, so after a 2 s run on a busy machine it may
    hold none of the requests."""
    return {e["name"]: e for e in json.loads((out / "stats.json").read_text())}


@pytest.mark.parametrize(
    ("protocol", "method", "failure"),
    [
        ("grpc", "Encode", "Encode bad: INVALID_ARGUMENT: "),
        ("http", "POST", "POST bad: HTTP 400: input 1 is an empty string"),
        ("tei", "POST", "POST bad: HTTP 400: input 1 is an empty string"),
    ],
)
def test_successes_and_failures_named_by_their_status(
    tiny_server: Server, tmp_path: Path, protocol: str, method: str, failure: str
) -> None:
    run = _locust(tiny_server, tmp_path, "short,bad", "--max-fail-ratio", "0.9", protocol=protocol)
    assert run.returncode == 0, run.stderr[-3000:]

    entries = _entries(tmp_path)
    short, bad = entries["short"], entries["bad"]
    assert short["method"] == method and short["num_requests"] > 0 and short["num_failures"] == 0
    assert bad["num_failures"] == bad["num_requests"] > 0

    # The error report printed at exit names every failure by its gRPC status (HTTP status and message).
    errors = [m.group(1) for m in re.finditer(r"^\s*\d+\s+(\w+ \w+: .+)$", run.stderr, re.M)]
    assert errors and all(e.startswith(failure) for e in errors), errors
    for csv_file in ("stats_stats.csv", "stats_failures.csv"):  # written too, for `make loadtest`'s reports
        assert (tmp_path / csv_file).stat().st_size > 0


@pytest.mark.parametrize("protocol", ["grpc", "http", "tei"])
def test_the_ids_workload_records_an_unknown_model_as_failures(
    tiny_server: Server, tmp_path: Path, protocol: str
) -> None:
    """Its users ask for the model's shape first: that call failing once killed each user at its start, and
    the run idled to its end with no request recorded."""
    run = _locust(tiny_server, tmp_path, "ids", "--model", "nope", protocol=protocol)
    assert run.returncode == 1, run.stderr[-3000:]
    info = _entries(tmp_path)["model info"]
    assert info["num_failures"] == info["num_requests"] > 0
    assert ("NOT_FOUND" if protocol == "grpc" else "HTTP 404") in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_ids_workload_records_each_model_info_call_that_succeeds_too(
    tiny_server: Server, tmp_path: Path, protocol: str
) -> None:
    """Each user asks for the model's shape once: only the failed calls were recorded, so any failure of that row
    read as 100 % of it (4 of 4 where 4 of 6 had failed)."""
    run = _locust(tiny_server, tmp_path, "ids", protocol=protocol)
    assert run.returncode == 0, run.stderr[-3000:]
    info = _entries(tmp_path)["model info"]
    assert (info["num_requests"], info["num_failures"]) == (4, 0)  # one for each of the 4 users


def test_the_ids_workload_with_a_tokenizer_asks_for_no_model_info(
    tiny_server: Server, tiny_entry: Path, tmp_path: Path
) -> None:
    """With --tokenizer the ids are its own: no call for the model's shape is made, and none is recorded."""
    run = _locust(tiny_server, tmp_path, "ids", "--tokenizer", str(tiny_entry / "tokenizer.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    entries = _entries(tmp_path)
    assert "model info" not in entries and entries["ids"]["num_requests"] > 0


def test_a_grpc_host_without_a_port_dials_the_servers_default(tiny_server: Server, tmp_path: Path) -> None:
    """`-H 127.0.0.1` dialled grpc's default port, 443, where nothing listens; `mhaserve encode` and the users take
    an address alike: without a port, the server's (50051)."""
    run = _locust(tiny_server, tmp_path, "short", "--rpc-timeout", "0.5", host="127.0.0.1")
    said = run.stdout + run.stderr
    assert "127.0.0.1:443" not in said, said[-3000:]
    short = _entries(tmp_path)["short"]
    # nothing listens there here (then the failures name it), or a server does (then it answers)
    assert "127.0.0.1:50051" in said or short["num_failures"] == 0, said[-3000:]


def test_an_http_call_past_the_rpc_timeout_is_named_a_timeout(tmp_path: Path) -> None:
    """Once named CONNECTION, as a refused connection is, and backed off from."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections (the backlog) and never answers
        host = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cmd = [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--protocol", "http", "-H", host,
            "-u", "2", "-r", "2", "-t", "2s", "--only-summary", "--workload", "short", "--rpc-timeout", "0.3",
            "--json-file", str(tmp_path / "stats"),
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 1
    errors = [m.group(1) for m in re.finditer(r"^\s*\d+\s+(\w+ \w+: .+)$", run.stderr, re.M)]
    assert errors and all(e.startswith("POST short: TIMEOUT: no answer within --rpc-timeout 0.3 s") for e in errors), (
        errors
    )


class _Answers200(BaseHTTPRequestHandler):
    """A server that answers 200 with `body` to every GET and POST: a proxy's own page, as a captive portal or
    a misrouted load balancer answers, or JSON of another shape than the client asked for."""

    protocol_version = "HTTP/1.1"
    body = b"<html><body>Welcome to the proxy</body></html>"
    content_type = "text/html"

    def do_GET(self) -> None:
        self.do_POST()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *_: Any) -> None:
        pass


def _locust_against_200s(
    out: Path, protocol: str, workload: str, *extra: str, body: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    """Locust run against a server that answers every call 200 with `body` (an HTML page by default), on a
    free 127.0.0.1 port."""
    handler = (
        _Answers200
        if body is None
        else type("_Json200", (_Answers200,), {"body": body, "content_type": "application/json"})
    )
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            return _two_users(f"http://127.0.0.1:{server.server_address[1]}", out, protocol, workload, *extra)
        finally:
            server.shutdown()


def _two_users(host: str, out: Path, protocol: str, workload: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """A 2 s Locust run of two users against `host`."""
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--protocol", protocol,
        "-H", host, "-u", "2", "-r", "2", "-t", "2s",
        "--only-summary", "--workload", workload, "--json-file", str(out / "stats"), *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())


def _only_failures(run: subprocess.CompletedProcess[str], out: Path, name: str, message: str) -> None:
    """Every request of task `name` failed with an error that begins with `message` (what follows it is the
    answer's first bytes), and none escaped its task as an exception."""
    assert run.returncode == 1, run.stderr[-3000:]
    entry = _entries(out)[name]
    assert entry["num_failures"] == entry["num_requests"] > 0
    # Locust's error table: occurrences, then "<request type> <task name>: <error>"
    errors = [m.group(1) for m in re.finditer(r"^\s*\d+\s+\w+ (.+)$", run.stderr, re.M)]
    assert errors and all(e.startswith(f"{name}: {message}") for e in errors), errors
    assert "exceptions" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("protocol", ["http", "tei"])
@pytest.mark.parametrize(
    ("workload", "name", "body", "message"),
    [
        ("short", "short", None, "BAD_RESPONSE: a 200 whose body is not JSON: <html>"),
        ("short", "short", b'{"object": "list"}', 'BAD_RESPONSE: a 200 without the embeddings: {"object"'),
        ("short", "short", b"", "BAD_RESPONSE: a 200 whose body is not JSON: (empty)"),
        ("ids", "model info", None, "BAD_RESPONSE: GET /info: a 200 whose body is not JSON: <html>"),
    ],
    ids=["html", "json", "empty", "info-html"],
)
def test_an_answer_that_holds_no_embeddings_is_a_failed_call(
    tmp_path: Path, protocol: str, workload: str, name: str, body: bytes | None, message: str
) -> None:
    """A 200 whose body is not the protocol's answer (or not GET /info's, which the ids users ask first): each
    call a BAD_RESPONSE failure under its task's name, saying whether the body is no JSON at all (a proxy's
    page) or JSON without the embeddings, where the JSON error escaped the task as an exception and no
    request was recorded."""
    run = _locust_against_200s(tmp_path, protocol, workload, body=body)
    _only_failures(run, tmp_path, name, message)


@pytest.mark.parametrize(
    ("body", "extra", "message"),
    [
        # The model asked for is served, but its entry lacks the shape: a KeyError once escaped the task.
        (
            b'{"models": [{"model": "m", "version": 1}]}',
            ("--model", "m"),
            "a 200 without vocab_size and max_input_length for model 'm': {\"models\"",
        ),
        # Each message names what is missing: "without the model's vocab_size and max_input_length" once stood
        # for a missing version, a missing list of models, or a body that is no object.
        (b'{"vocab_size": 30522}', (), 'a 200 without max_input_length for the model: {"vocab_size"'),
        (
            b'{"models": [{"model": "m"}]}',
            ("--model", "m"),
            'a 200 whose served model has no \'version\': {"model":"m"}',
        ),
        (
            b'{"models": [{"version": 1}]}',
            ("--model", "m"),
            "a 200 whose served model has no 'model': {\"version\":1}",
        ),
        (
            b'{"vocab_size": 30522, "max_input_length": 256}',
            ("--model", "m"),
            "a 200 without the list of served models ('models') that --model m is looked for in: {\"vocab_size\"",
        ),
        (b"[1, 2]", (), "a 200 whose JSON is no object: [1, 2]"),
        # The shape in the wrong types, or a vocabulary no id can be drawn from: each raised in the ids' draw.
        (
            b'{"vocab_size": "many", "max_input_length": 256}',
            (),
            "vocab_size 'many', where a whole number of at least 2 was expected",
        ),
        (
            b'{"vocab_size": 30522, "max_input_length": null}',
            (),
            "max_input_length None, where a whole number of at least 1 was expected",
        ),
        (b'{"vocab_size": 1, "max_input_length": 256}', (), "vocab_size 1, where a whole number of at least 2 was"),
        # Both wrong: each named, in the answer's order
        (
            b'{"vocab_size": 0, "max_input_length": "all"}',
            (),
            "vocab_size 0, where a whole number of at least 2 was expected; max_input_length 'all', where a whole "
            "number of at least 1 was expected",
        ),
    ],
    ids=[
        "entry-without-shape",
        "without-max-length",
        "entry-without-version",
        "entry-without-name",
        "no-models",
        "not-an-object",
        "vocab-not-a-number",
        "max-length-null",
        "vocab-of-one",
        "both-wrong",
    ],
)
def test_model_info_of_another_shape_is_a_failed_call(
    tmp_path: Path, body: bytes, extra: tuple[str, ...], message: str
) -> None:
    """GET /info answered 200 with JSON, but not the model's vocabulary size and most tokens per input as
    numbers the ids users can draw from: a BAD_RESPONSE failure, where the error escaped the task, saying what
    of the answer is missing or wrong."""
    run = _locust_against_200s(tmp_path, "http", "ids", *extra, body=body)
    _only_failures(run, tmp_path, "model info", f"BAD_RESPONSE: GET /info: {message}")


def test_get_model_info_of_another_shape_is_a_failed_call(tmp_path: Path) -> None:
    """Over gRPC the ids users ask GetModelInfo first: an answer whose shape is unset (zeros: a server of another
    encoder.v1, say) is a BAD_RESPONSE failure naming both fields as GetModelInfo names them."""

    class Unset(pb_grpc.EncoderServiceServicer):
        def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> Any:
            return pb.GetModelInfoResponse(name="m", version=1)

    server = grpc.server(ThreadPoolExecutor(2))
    pb_grpc.add_EncoderServiceServicer_to_server(Unset(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        run = _two_users(f"127.0.0.1:{port}", tmp_path, "grpc", "ids")
    finally:
        server.stop(0)
    _only_failures(
        run,
        tmp_path,
        "model info",
        "BAD_RESPONSE: GetModelInfo: vocab_size 0, where a whole number of at least 2 was expected; "
        "max_tokens_per_input 0, where a whole number of at least 1 was expected",
    )


def test_exit_status_follows_the_failure_threshold(tiny_server: Server, tmp_path: Path) -> None:
    run = _locust(tiny_server, tmp_path, "short,bad", "--max-fail-ratio", "0.05")
    assert run.returncode == 1
    assert "more than the allowed 5.00%" in run.stderr


def test_every_other_task_set_succeeds(tiny_server: Server, tmp_path: Path) -> None:
    run = _locust(
        tiny_server, tmp_path, "query,long,mixed,batch,ids,stream", "--batch-size", "3", "--max-fail-ratio", "0"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    entries = _entries(tmp_path)
    for name in ("query", "long", "mixed", "batch3", "ids", "stream"):
        assert entries[name]["num_requests"] > 0, name
        assert entries[name]["num_failures"] == 0, name
    assert entries["stream"]["method"] == "EncodeStream"


# ---- calls in flight when the run ends -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stoppable_server(tiny_entry: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server of its own for the tests that stop it (SIGSTOP): the other tests' server stays up."""
    server = bench_server(tiny_entry, tmp_path_factory.mktemp("stoppable") / "server.log")
    with server.running():
        yield server


def _hang_during(
    server: Server, cmd: list[str], log: Path, stop: signal.Signals | None = None, group: bool = False
) -> tuple[int, str]:
    """Run Locust (`cmd`) and stop the server from answering (SIGSTOP) a second after its users have spawned; with
    `stop`, send Locust that signal 3 s later (to it alone, or with `group` to its process group, --processes'
    workers too, as a terminal's Ctrl-C), else let its --run-time end it. Its exit status and its output."""
    with log.open("w") as out:
        # its own process group, as a shell's job is: Ctrl-C reaches Locust alone; and SIGINT handled, as in a
        # terminal, though a suite run in the background (`make test &`) hands its children SIGINT ignored
        locust = subprocess.Popen(
            _own_master(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=_env(),
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
        )
        try:
            wait_until(lambda: "All users spawned" in log.read_text(), "Locust's users", timeout=60)
            time.sleep(1)
            os.kill(server.pid, signal.SIGSTOP)
            try:
                if stop is not None:
                    time.sleep(3)
                    if group:
                        os.killpg(locust.pid, stop)  # its own session: the group is Locust and its forks alone
                    else:
                        os.kill(locust.pid, stop)
                locust.wait(timeout=60)
            finally:
                os.kill(server.pid, signal.SIGCONT)
        finally:
            if locust.poll() is None:
                locust.kill()
                locust.wait()
    return locust.returncode, log.read_text()


@pytest.mark.parametrize(
    ("protocol", "extra"),
    [("grpc", ()), ("http", ()), ("grpc", ("--processes", "2"))],
    ids=["grpc", "http", "grpc-processes"],
)
def test_calls_left_unanswered_when_the_run_ends_fail_it(
    stoppable_server: Server, tmp_path: Path, protocol: str, extra: tuple[str, ...]
) -> None:
    """The server stops answering (SIGSTOP) a second into a 7 s run. The calls its users wait on were killed
    with them at the end and never recorded: "N requests, 0 failures", exit 0. Each is now an IN_FLIGHT
    failure with the time it waited, and the run fails even where the ratio allows 90 % of failures: in a
    long run a hung server's unanswered calls, one per user, are too few for any ratio. With --processes,
    the workers' failures reach the master's figures."""
    host = stoppable_server.http_url if protocol == "http" else stoppable_server.address
    log = tmp_path / "locust.log"
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--protocol", protocol, "-H", host,
        "-u", "2", "-r", "2", "-t", "7s", "--only-summary", "--workload", "short", "--max-fail-ratio", "0.9",
        "--json-file", str(tmp_path / "stats"), *extra,
    ]  # fmt: skip
    returncode, text = _hang_during(stoppable_server, cmd, log)
    assert returncode == 1, text[-3000:]
    short = _entries(tmp_path)["short"]
    # One call of each of the two users (the second once went unrecorded: the first one's wait had become
    # the slowest call of the run, which the bound doubles).
    assert short["num_failures"] == 2 and short["num_requests"] > 2, short
    assert short["max_response_time"] > 3000  # the unanswered calls' waits, in the figures
    assert "short: IN_FLIGHT: no answer when the run ended" in text, text[-3000:]
    assert re.search(r"\d+ calls? had no answer when the run ended", text), text[-3000:]


@pytest.mark.parametrize(
    ("stop", "extra", "group"),
    [
        (signal.SIGTERM, (), False),
        (signal.SIGINT, (), False),
        (signal.SIGTERM, ("--processes", "2"), False),
        # a terminal's Ctrl-C reaches the workers too: they stopped at once, before their unanswered calls reached
        # the master, and the run exited 0
        (signal.SIGINT, ("--processes", "2"), True),
    ],
    ids=["SIGTERM", "Ctrl-C", "SIGTERM-processes", "Ctrl-C-processes"],
)
def test_a_run_stopped_by_a_signal_while_the_server_hangs_fails_and_its_csv_says_so(
    stoppable_server: Server, tmp_path: Path, stop: signal.Signals, extra: tuple[str, ...], group: bool
) -> None:
    """A run ended by `timeout`, `docker stop`, a CI's cancel (SIGTERM) or Ctrl-C, the server hung: Locust decides
    its exit status before it stops the users, and the calls they wait on became IN_FLIGHT failures only after,
    so the run exited 0. And its CSV, which Locust writes once a second and not at exit, left those failures
    and the run's last second out of `make loadtest`'s report. The users now stop first, and the CSV is written
    once more."""
    log = tmp_path / "locust.log"
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-H", stoppable_server.address,
        "-u", "2", "-r", "2", "-t", "60s", "--only-summary", "--workload", "short", "--max-fail-ratio", "0.9",
        "--json-file", str(tmp_path / "stats"), "--csv", str(tmp_path / "stats"), *extra,
    ]  # fmt: skip
    returncode, text = _hang_during(stoppable_server, cmd, log, stop, group)
    assert returncode == 1, text[-3000:]
    assert re.search(r"\d+ calls? had no answer when the run ended", text), text[-3000:]
    short = _entries(tmp_path)["short"]
    assert short["num_failures"] == 2, short
    with (tmp_path / "stats_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert (int(rows["short"]["Request Count"]), int(rows["short"]["Failure Count"])) == (
        short["num_requests"],
        short["num_failures"],
    ), rows["short"]
    with (tmp_path / "stats_failures.csv").open() as f:
        failures = list(csv.DictReader(f))
    assert [row["Error"].split(":")[0] for row in failures] == [IN_FLIGHT_ERROR], failures


class _SlowTei(BaseHTTPRequestHandler):
    """TEI's `POST /embed`, every answer 1.2 s late: one vector (of one zero) per input."""

    protocol_version = "HTTP/1.1"  # keep-alive, as the users' connections are

    def do_POST(self) -> None:
        inputs = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["inputs"]
        time.sleep(1.2)
        body = json.dumps([[0.0]] * len(inputs)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def test_a_run_of_slow_calls_does_not_fail_on_those_in_flight_at_its_end(tmp_path: Path) -> None:
    """Every run ends with calls in flight; a slow server's last ones have waited up to a second and more
    (the tiny model answers in milliseconds, hence a stand-in that answers in 1.2 s). They are no sign of
    a server that stopped answering, and the run, with no failure allowed, passes."""
    with ThreadingHTTPServer(("127.0.0.1", 0), _SlowTei) as slow:
        thread = threading.Thread(target=slow.serve_forever, daemon=True)
        thread.start()
        try:
            cmd = [
                sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--protocol", "tei",
                "-H", f"http://127.0.0.1:{slow.server_address[1]}", "-u", "2", "-r", "2", "-t", "4s",
                "--only-summary", "--workload", "short", "--max-fail-ratio", "0",
                "--json-file", str(tmp_path / "stats"),
            ]  # fmt: skip
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
        finally:
            slow.shutdown()
    assert run.returncode == 0, run.stderr[-3000:]
    short = _entries(tmp_path)["short"]
    assert short["num_requests"] > 0 and short["num_failures"] == 0


# ---- over HTTP: OpenAI POST /v1/embeddings -------------------------------------------------------------


@pytest.mark.parametrize(
    ("protocol", "extra"), [("http", ("--encoding-format", "base64")), ("tei", ())], ids=["openai-base64", "tei"]
)
def test_http_every_task_set_but_stream_succeeds(
    tiny_server: Server, tmp_path: Path, protocol: str, extra: tuple[str, ...]
) -> None:
    """OpenAI's route (with base64 vectors) and TEI's `/embed`: every input answered, none failed."""
    run = _locust(
        tiny_server, tmp_path, "query,long,mixed,batch,ids", "--batch-size", "3", *extra,
        "--max-fail-ratio", "0", protocol=protocol,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    entries = _entries(tmp_path)
    for name in ("query", "long", "mixed", "batch3", "ids"):
        assert entries[name]["num_requests"] > 0, name
        assert entries[name]["num_failures"] == 0, name
        assert entries[name]["method"] == "POST"


@pytest.mark.parametrize("protocol", ["http", "tei"])
def test_http_refuses_the_grpc_only_stream(tiny_server: Server, tmp_path: Path, protocol: str) -> None:
    run = _locust(tiny_server, tmp_path, "stream", protocol=protocol)
    assert run.returncode == 2
    assert "--workload stream is gRPC only" in run.stderr


def test_an_unknown_workload_is_refused_before_the_run(tiny_server: Server, tmp_path: Path) -> None:
    # Refused at start-up (exit 2, as argparse does), not in each user after which the run idled; no
    # request is made, and nothing is written as if a run had happened.
    run = _locust(tiny_server, tmp_path, "shrot", "-t", "30s")
    assert run.returncode == 2
    assert "--workload 'shrot': unknown ['shrot']; choose from" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "stats.json").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--batch-size", "0"), "--batch-size must be >= 1, got 0"),
        (("--stream-requests", "0"), "--stream-requests must be >= 1, got 0"),
        (("--max-fail-ratio", "-1"), "--max-fail-ratio must be a fraction in [0, 1], got -1.0"),
        # grpcio failed every call at once as DEADLINE_EXCEEDED, blaming the server, past about 1e9 s
        (("--rpc-timeout", "inf"), "--rpc-timeout must be > 0 and at most 100000000 (seconds), got inf"),
        (("--rpc-timeout", "1e10"), "--rpc-timeout must be > 0 and at most 100000000 (seconds), got 10000000000.0"),
        (("--think-time", "inf"), "--think-time must be >= 0 and at most 100000000 (seconds), got inf"),
        (("--corpus", "/nonexistent/corpus.txt"), "--corpus /nonexistent/corpus.txt: no such file"),
        (("--tokenizer", "/nonexistent/tokenizer.json"), "--tokenizer /nonexistent/tokenizer.json: no such file"),
        (("--corpus", "/tmp"), "--corpus /tmp is a directory: give a file"),  # was "no such file"
        (("--tls-ca", "/tmp"), "--tls-ca /tmp is a directory: give a file"),
        (("--tokenizer", str(LOCUSTFILE)), f"--tokenizer {LOCUSTFILE} is no tokenizer.json"),
        (("--tls-ca", "/nonexistent/ca.pem"), "--tls-ca /nonexistent/ca.pem: no such file"),
        (("--tls-ca", str(LOCUSTFILE)), f"--tls-ca {LOCUSTFILE} holds no usable PEM certificate"),
        (
            ("--tls-client-cert", str(LOCUSTFILE)),
            "--tls-client-cert and --tls-client-key go together (the client certificate and its key)",
        ),
    ],
)
def test_bad_options_are_refused_before_the_run(
    tiny_server: Server, tmp_path: Path, options: tuple[str, ...], message: str
) -> None:
    """Each of these failed in every user's start (or ran requests the server had to refuse, or reported
    'no requests were made: is the server up?'), and the run idled for its whole --run-time."""
    run = _locust(tiny_server, tmp_path, "mixed", *options, "-t", "30s")
    assert run.returncode == 2, run.stderr[-2000:]
    assert message in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("flag", "content", "problem"),
    [
        ("--corpus", b"", "holds no text (it is empty, or blank lines only)"),
        ("--short-corpus", b"  \n\t\n\n", "holds no text (it is empty, or blank lines only)"),
        ("--corpus", b"caf\xe9 au lait\n", "is not UTF-8 text (byte 0xe9 at offset 3)"),
        ("--short-corpus", b"\xff\xfeq\x00", "is not UTF-8 text (byte 0xff at offset 0)"),
    ],
)
def test_a_corpus_without_usable_text_is_refused_before_the_run(
    tiny_server: Server, tmp_path: Path, flag: str, content: bytes, problem: str
) -> None:
    """Once it passed the check (the file exists), every user's start failed on it ("the corpus is empty", or a
    UnicodeDecodeError), and the run idled to its end and blamed the server: no requests were made."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    run = _locust(tiny_server, tmp_path, "mixed,short", flag, str(corpus), "-t", "30s")
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"{flag} {corpus} {problem}" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "stats.json").exists()


def test_a_file_that_is_no_tokenizer_is_refused_before_the_ids_workload(tiny_server: Server, tmp_path: Path) -> None:
    """The ids task caught only failed calls: the tokenizer was parsed again, and failed, in every task (tens
    of thousands of tracebacks a second) and no request was made."""
    run = _locust(tiny_server, tmp_path, "ids", "--tokenizer", str(LOCUSTFILE), "-t", "30s")
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"--tokenizer {LOCUSTFILE} is no tokenizer.json (" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.splitlines()) < 20, run.stderr[-2000:]


def test_a_run_whose_users_raised_exceptions_fails(tiny_server: Server, tmp_path: Path) -> None:
    """An exception in a task is no request, failed or not: a run of short and bad-tokenizer ids tasks
    counted 98 requests, no failures, and exited 0 with 75 exceptions in stats_exceptions.csv. Here a
    locustfile that wraps the real one makes its `query` task raise."""
    wrapper = tmp_path / "raising_locustfile.py"
    wrapper.write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('mhaserve_locustfile', {str(LOCUSTFILE)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "def task_query(self):\n"
        "    raise RuntimeError('a bug in the query task')\n"
        "module.EncoderUser.task_query = task_query\n"
        "EncoderUser = module.EncoderUser\n"
    )
    host = tiny_server.address
    cmd = [
        sys.executable, "-m", "locust", "-f", str(wrapper), "--headless", "-H", host, "-u", "2", "-r", "2",
        "-t", "2s", "--only-summary", "--workload", "short,query", "--max-fail-ratio", "0.9",
        "--json-file", str(tmp_path / "stats"),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
    assert run.returncode == 1, run.stderr[-3000:]
    short = _entries(tmp_path)["short"]
    assert short["num_requests"] > 0 and short["num_failures"] == 0
    assert re.search(r"the users raised \d+ exceptions? \(a bug in the query task\)", run.stderr), run.stderr[-3000:]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--tls-ca", "/nonexistent/ca.pem"), "--tls-ca /nonexistent/ca.pem: no such file"),
        (("--corpus", "/nonexistent/corpus.txt"), "--corpus /nonexistent/corpus.txt: no such file"),
    ],
)
def test_with_processes_the_master_refuses_bad_files_too(
    tiny_server: Server, tmp_path: Path, options: tuple[str, ...], message: str
) -> None:
    """`--processes N` forks N workers from the master after it read its options: the workers refused the
    file and exited 2, while the master, which skipped the files (a master's paths may not be its workers'),
    waited for them through its whole --run-time and exited 1, "no requests were made"."""
    started = time.monotonic()
    run = _locust(tiny_server, tmp_path, "mixed", "--processes", "2", *options, "-t", "30s")
    assert run.returncode == 2, run.stderr[-2000:]
    assert message in run.stderr and "no requests were made" not in run.stderr
    assert time.monotonic() - started < 20


def test_with_processes_a_master_that_refuses_ends_the_workers_it_forked(tiny_server: Server, tmp_path: Path) -> None:
    """A forked worker connects to its master before it reads its options: one slower than its master (a busy
    machine) was still waiting for an answer when the master refused the options and exited 2, and went on
    waiting, and logging that it could not connect, for five minutes. Locust's own end of the run signals only
    the workers that have exited already. Here each fork sleeps 3 s first."""
    slow = tmp_path / "slow_locustfile.py"
    slow.write_text(
        "import os, sys\n"
        "from gevent import monkey\n"
        f"sys.path.insert(0, {str(LOCUSTFILE.parent)!r})\n"
        "from locustfile import *  # noqa: F403\n"
        "os.register_at_fork(after_in_child=lambda: monkey.get_original('time', 'sleep')(3))\n"
    )
    started = time.monotonic()
    cmd = [
        sys.executable, "-m", "locust", "-f", str(slow), "--headless", "-H", tiny_server.address,
        "-u", "2", "-r", "2", "-t", "30s", "--processes", "2", "--tls-ca", "/nonexistent/ca.pem",
    ]  # fmt: skip
    run = subprocess.Popen(
        _own_master(cmd),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
        start_new_session=True,
    )
    try:
        _, err = run.communicate(timeout=30)  # until the pipe's end: the master's and every worker's
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # a worker left behind, when this fails
        run.wait()
    assert run.returncode == 2 and "--tls-ca /nonexistent/ca.pem: no such file" in err, err[-2000:]
    assert time.monotonic() - started < 20, err[-2000:]


def test_a_worker_reads_the_corpus_beside_its_own_locustfile(tiny_server: Server, tmp_path: Path) -> None:
    """Distributed: the master sends its options to the workers. A default corpus path of the master's own
    checkout (here a copy of the locustfile with no corpus beside it) named nothing on the worker."""
    master_dir = tmp_path / "master"
    master_dir.mkdir()
    (master_dir / "locustfile.py").write_text(LOCUSTFILE.read_text())
    port = str(free_port())
    master = subprocess.Popen(
        [
            sys.executable, "-m", "locust", "-f", str(master_dir / "locustfile.py"), "--master", "--headless",
            "--master-bind-host", "127.0.0.1", "--master-bind-port", port, "--expect-workers", "1",
            "-H", tiny_server.address, "-u", "2", "-r", "2", "-t", "3s", "--workload", "mixed,short",
            "--json-file", str(tmp_path / "stats"), "--max-fail-ratio", "0",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=master_dir,
    )  # fmt: skip
    worker = _worker(port)
    try:
        out, _ = master.communicate(timeout=60)
    finally:
        worker.kill()
        worker.wait()
    assert master.returncode == 0, out[-3000:]
    assert sum(e["num_requests"] for e in _entries(tmp_path).values()) > 0


@pytest.mark.parametrize(
    ("options", "message", "ui"),
    [
        (("--tls-ca", "/nonexistent/ca.pem"), "--tls-ca /nonexistent/ca.pem: no such file", "--headless"),
        (("--corpus", "/nonexistent/corpus.txt"), "--corpus /nonexistent/corpus.txt: no such file", "--headless"),
        # the web UI beside a run started by itself: it waited for its --run-time, and exited 1
        (("--corpus", "/nonexistent/corpus.txt"), "--corpus /nonexistent/corpus.txt: no such file", "--autostart"),
    ],
)
def test_a_separate_worker_refuses_the_masters_bad_files(
    tiny_server: Server, tmp_path: Path, options: tuple[str, ...], message: str, ui: str
) -> None:
    """A separate worker gets the master's options only with the run's start, after it checked its own command
    line: its users failed in their start, the run idled through its whole --run-time, and the master exited 1,
    blaming the server ("no requests were made") before it named the file."""
    port, web_port = map(str, free_ports(2))
    started = time.monotonic()
    master = subprocess.Popen(
        [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--master", ui, "--web-host", "127.0.0.1",
            "--web-port", web_port,
            "--master-bind-host", "127.0.0.1", "--master-bind-port", port, "--expect-workers", "1",
            "-H", tiny_server.address, "-u", "2", "-r", "2", "-t", "90s", "--workload", "mixed", *options,
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=_env(),
    )  # fmt: skip
    worker = _worker(port)
    try:
        out, _ = master.communicate(timeout=120)
        elapsed = time.monotonic() - started
        worker_out, _ = worker.communicate(timeout=15)  # it ends too, not left waiting for a master that is gone
    finally:
        for process in (master, worker):
            process.kill()
            process.wait()
    assert master.returncode == 2, out[-3000:]
    assert out.count(message) == 1 and "no requests were made" not in out, out[-3000:]
    assert "Traceback" not in out + worker_out, (out + worker_out)[-3000:]
    assert elapsed < 45, out[-3000:]  # refused, not run out (90 s), however busy the machine


# ---- API keys and TLS ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(tiny_repo: Path) -> Iterator[ServerThread]:
    with ServerThread(local_settings(tiny_repo, api_keys=ApiKeys((KEY,)))) as srv:
        yield srv.ready()


@pytest.fixture(scope="module")
def tls_server(tiny_repo: Path, pki: Pki) -> Iterator[ServerThread]:
    with ServerThread(local_settings(tiny_repo, tls_cert=pki.server_cert, tls_key=pki.server_key)) as srv:
        yield srv.ready()


@pytest.fixture(scope="module")
def mtls_server(tiny_repo: Path, pki: Pki) -> Iterator[ServerThread]:
    settings = local_settings(
        tiny_repo, tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca, api_keys=ApiKeys((KEY,))
    )
    with ServerThread(settings) as srv:
        yield srv.ready()


def _https(server: ServerThread) -> str:
    return f"https://127.0.0.1:{server.server.http_port}"


def _no_key_shown(run: subprocess.CompletedProcess[str], out: Path) -> None:
    """The key is in no output and no report: the log, the summary, the CSV, JSON and HTML files."""
    assert KEY not in run.stdout + run.stderr
    for written in out.iterdir():
        assert KEY not in written.read_text(errors="replace"), written.name


@pytest.mark.parametrize(
    ("protocol", "workload", "given"),
    [("grpc", "short,ids,stream", "env"), ("http", "short,ids", "flag")],
)
def test_the_api_key_goes_with_every_call(
    keyed_server: ServerThread, tmp_path: Path, protocol: str, workload: str, given: str
) -> None:
    """From MHASERVE_API_KEY, as `mhaserve encode` takes it, or --api-key: as the bearer metadata of every
    gRPC call (Encode, GetModelInfo, EncodeStream), and as the Authorization header of every HTTP request."""
    ok, refused = keyed_server.counted_all("OK"), keyed_server.counted_all("UNAUTHENTICATED")
    run = _locust(
        keyed_server, tmp_path, workload, "-u", "2", "-r", "2", "--max-fail-ratio", "0",
        "--html", str(tmp_path / "report.html"),
        *(["--api-key", KEY] if given == "flag" else []),
        protocol=protocol,
        env=_env(MHASERVE_API_KEY=KEY) if given == "env" else None,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    entries = _entries(tmp_path)
    for name in workload.split(","):
        assert entries[name]["num_requests"] > 0 and entries[name]["num_failures"] == 0, name
    # The server answered them all (an EncodeStream call carries several of Locust's requests).
    calls = sum(e["num_requests"] for e in entries.values() if e["method"] != "EncodeStream")
    assert keyed_server.counted_all("OK") - ok >= calls
    assert keyed_server.counted_all("UNAUTHENTICATED") == refused
    _no_key_shown(run, tmp_path)


@pytest.mark.parametrize(
    ("protocol", "workload", "key", "failure"),
    [
        ("grpc", "short", None, "UNAUTHENTICATED"),
        ("grpc", "stream", "k-wrong", "UNAUTHENTICATED"),
        ("http", "short", "k-wrong", "HTTP 401"),
        ("tei", "short", None, "HTTP 401"),
    ],
)
def test_a_key_the_server_refuses_stops_the_run(
    keyed_server: ServerThread, tmp_path: Path, protocol: str, workload: str, key: str | None, failure: str
) -> None:
    """Every call of such a run is refused the same way: its users went on for its whole --run-time, each
    sending its next call the moment the last was refused (9,000 a second at a server), and the run measured
    nothing. It stops at the first refusal instead, as a bad option stops it (exit 2), the refusal named; the
    calls made are in the figures. (Here -t 120s: the run must end long before, or the subprocess times out.)"""
    refused = keyed_server.counted_all("UNAUTHENTICATED")
    run = _locust(
        keyed_server, tmp_path, workload, "-u", "2", "-r", "2", "-t", "120s",
        *(["--api-key", key] if key else []), protocol=protocol,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"the server refused this run's credentials ({failure}: " in run.stderr, run.stderr[-3000:]
    assert "--api-key" in run.stderr and "is the server" not in run.stderr
    entries = _entries(tmp_path)
    made = sum(e["num_requests"] for e in entries.values())
    assert sum(e["num_failures"] for e in entries.values()) == made > 0
    assert keyed_server.counted_all("UNAUTHENTICATED") - refused >= 1
    assert "Traceback" not in run.stderr
    if key:
        assert key not in run.stdout + run.stderr


def test_distributed_a_key_the_server_refuses_stops_the_run(keyed_server: ServerThread, tmp_path: Path) -> None:
    """A worker's users meet the refusal: the worker tells its master, which ends the run (exit 2) and names it."""
    port = str(free_port())
    master = subprocess.Popen(
        [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--master", "--headless",
            "--master-bind-host", "127.0.0.1", "--master-bind-port", port, "--expect-workers", "1",
            "-H", keyed_server.address, "-u", "2", "-r", "2", "-t", "120s", "--workload", "short",
            "--json-file", str(tmp_path / "stats"),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=_env(),
    )  # fmt: skip
    worker = _worker(port)
    try:
        out, _ = master.communicate(timeout=60)
        worker_out, _ = worker.communicate(timeout=30)  # told to quit by its master
    finally:
        master.kill()
        worker.kill()
    assert master.returncode == 2, out[-3000:]
    assert out.count("the server refused this run's credentials (UNAUTHENTICATED: ") == 1, out[-3000:]
    assert "Traceback" not in out + worker_out


def test_a_bad_api_key_is_refused_before_the_run_and_not_shown(keyed_server: ServerThread, tmp_path: Path) -> None:
    """One the server cannot take (grpc core refused it as "INTERNAL: Invalid metadata" in every call)."""
    run = _locust(keyed_server, tmp_path, "short", env=_env(MHASERVE_API_KEY="k-1 hush-hush"))
    assert run.returncode == 2
    assert "--api-key (or $MHASERVE_API_KEY): an API key is printable ASCII without spaces" in run.stderr
    assert "hush-hush" not in run.stdout + run.stderr


@pytest.mark.parametrize("holder", ["master", "worker"])
def test_distributed_the_key_of_the_master_or_of_each_worker(
    keyed_server: ServerThread, tmp_path: Path, holder: str
) -> None:
    """The master sends its options to its workers, the key among them; a worker given none by its master
    uses its own MHASERVE_API_KEY (a deployment may set it on the workers only)."""
    port = str(free_port())
    master = subprocess.Popen(
        [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--master", "--headless",
            "--master-bind-host", "127.0.0.1", "--master-bind-port", port, "--expect-workers", "1",
            "-H", keyed_server.address, "-u", "2", "-r", "2", "-t", "3s", "--workload", "short,stream",
            "--json-file", str(tmp_path / "stats"), "--max-fail-ratio", "0",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env=_env(MHASERVE_API_KEY=KEY) if holder == "master" else _env(),
    )  # fmt: skip
    worker = _worker(port, _env(MHASERVE_API_KEY=KEY) if holder == "worker" else _env())
    try:
        out, _ = master.communicate(timeout=60)
    finally:
        worker.kill()
        worker_out, _ = worker.communicate()
    assert master.returncode == 0, out[-3000:]
    assert sum(e["num_requests"] for e in _entries(tmp_path).values()) > 0
    assert KEY not in out + worker_out


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tls_trusting_the_servers_ca(tls_server: ServerThread, pki: Pki, tmp_path: Path, protocol: str) -> None:
    """--tls-ca: gRPC over TLS, and HTTPS (an https:// host) verified against that CA."""
    host = _https(tls_server) if protocol == "http" else None
    run = _locust(
        tls_server, tmp_path, "short,ids", "-u", "2", "-r", "2", "--tls-ca", str(pki.ca), "--max-fail-ratio", "0",
        protocol=protocol, host=host,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    entries = _entries(tmp_path)
    assert entries["short"]["num_requests"] > 0 and entries["short"]["num_failures"] == 0


@pytest.mark.parametrize(
    ("protocol", "options", "failure"),
    [
        ("grpc", (), "short: UNAVAILABLE"),  # plaintext to a TLS port
        ("grpc", ("--tls",), "short: UNAVAILABLE"),  # the system's roots do not know the test CA
        ("http", (), "short: CONNECTION: SSL"),  # https:// with the system's roots
    ],
)
def test_tls_without_the_servers_ca_fails(
    tls_server: ServerThread, tmp_path: Path, protocol: str, options: tuple[str, ...], failure: str
) -> None:
    host = _https(tls_server) if protocol == "http" else None
    run = _locust(tls_server, tmp_path, "short", "-u", "1", "-r", "1", *options, protocol=protocol, host=host)
    assert run.returncode == 1, run.stderr[-3000:]
    short = _entries(tmp_path)["short"]
    assert short["num_failures"] == short["num_requests"] > 0
    assert failure in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_mutual_tls_with_a_client_certificate_and_the_key(
    mtls_server: ServerThread,
    pki: Pki,
    tmp_path: Path,
    protocol: str,
) -> None:
    """A client certificate the server's client CA signed, and the API key: the two combine. Over HTTP the
    host has no scheme: the TLS options make it https://."""
    host = f"127.0.0.1:{mtls_server.server.http_port}" if protocol == "http" else None
    run = _locust(
        mtls_server, tmp_path, "short,ids", "-u", "2", "-r", "2", "--tls-ca", str(pki.ca),
        "--tls-client-cert", str(pki.client_cert), "--tls-client-key", str(pki.client_key), "--max-fail-ratio", "0",
        protocol=protocol, host=host, env=_env(MHASERVE_API_KEY=KEY),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    entries = _entries(tmp_path)
    assert entries["short"]["num_requests"] > 0 and entries["short"]["num_failures"] == 0
    _no_key_shown(run, tmp_path)
