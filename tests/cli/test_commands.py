"""`mhaserve serve` as a real process (start-up errors, drain on SIGTERM/SIGINT), `encode` and `health`."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from mhaserve.cli.main import main
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service import client
from mhaserve.service.settings import Settings
from mhaserve.testing.http import request
from mhaserve.testing.loopback import WAIT, free_port, free_ports, wait_until
from mhaserve.testing.metrics import scrape
from mhaserve.testing.server import ServerThread, bare_settings
from tests.service.test_models import export, publish_copy

MHASERVE = str(Path(sys.executable).parent / "mhaserve")


def stdin(text: str | bytes) -> io.TextIOWrapper:
    """Standard input as the command reads it: bytes underneath (`sys.stdin.buffer`)."""
    return io.TextIOWrapper(io.BytesIO(text.encode() if isinstance(text, str) else text), "utf-8", newline="\n")


class Process:
    """`mhaserve serve ...` (or the scripted-engine server, `engine=` a spec) in a subprocess; its stderr
    collected line by line."""

    def __init__(self, *args: str, engine: str | None = None) -> None:
        command = [MHASERVE, "serve"] if engine is None else [sys.executable, "-m", "mhaserve.testing.fake_server"]
        command += ["--engine", engine] if engine is not None else []
        self.proc = subprocess.Popen([*command, *args], stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def port(self) -> int:
        found: list[int] = []

        def listening() -> bool:
            found.extend(int(m.group(1)) for m in re.finditer(r"listening on 127\.0\.0\.1:(\d+)", self.log))
            return bool(found) or self.proc.poll() is not None

        wait_until(listening, "the server to listen")
        assert found, self.log
        return found[0]

    def wait(self) -> int:
        code = self.proc.wait(WAIT)
        self.reader.join(WAIT)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT)


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for p in started:
        p.kill()


def _serving(address: str) -> bool:
    try:
        return client.health(address, timeout=1.0) == "SERVING"
    except grpc.RpcError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_every_queued_request_of_both_protocols_then_exits_0(
    tiny_repo: Path, processes: list[Process], sig: signal.Signals
) -> None:
    metrics, http = free_ports(2)
    # The engine holds the first batch (token 99) until SIGUSR1 (120 s at most): every request sent meanwhile
    # is queued behind it when the signal comes, and only the drain can answer them. A fixed hang raced the
    # test's own steps on a loaded machine. One inference worker: a second would compute the queue meanwhile.
    p = Process(
        *("--repository", str(tiny_repo), "--model", "tiny", "--port", "0", "--inference-workers", "1"),
        *("--metrics-port", str(metrics), "--http-port", str(http), "--device", "cpu"),
        engine="hang:99:120",
    )
    processes.append(p)
    address = f"127.0.0.1:{p.port()}"
    wait_until(lambda: _serving(address), "SERVING")
    texts = [[f"request {i}", "x " * i] for i in range(16)]
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(8) as pool:
        stub = pb_grpc.EncoderServiceStub(channel)
        held = stub.Encode.future(pb.EncodeRequest(token_ids=[pb.TokenIds(ids=[99])]), timeout=WAIT)
        # Sent before the held batch leaves the queue, the others could join it and never be counted as queued.
        wait_until(lambda: scrape(metrics).get("mhaserve_queue_wait_seconds_count") == 1, "the held batch to start")
        calls = [stub.Encode.future(pb.EncodeRequest(texts=t), timeout=WAIT) for t in texts[:8]]
        posts = [
            pool.submit(request, "POST", f"http://127.0.0.1:{http}/v1/embeddings", {"input": t}) for t in texts[8:]
        ]
        wait_until(lambda: scrape(metrics).get("mhaserve_queue_depth") == 32, "all 32 inputs queued")
        p.proc.send_signal(sig)
        wait_until(lambda: "shutting down: draining" in p.log, "the drain to begin")
        assert scrape(metrics).get("mhaserve_queue_depth") == 32, "the drain began with every input still queued"
        p.proc.send_signal(signal.SIGUSR1)
        responses = [c.result(timeout=WAIT) for c in calls]
        replies = [f.result(timeout=WAIT) for f in posts]
        assert len(held.result(timeout=WAIT).embeddings) == 1
    assert [len(r.embeddings) for r in responses] == [2] * 8
    assert [(r.status, len(r.json()["data"])) for r in replies] == [(200, 2)] * 8
    vectors = [e.values for r in responses for e in r.embeddings] + [
        d["embedding"] for r in replies for d in r.json()["data"]
    ]
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert p.wait() == 0, p.log
    assert "shutting down: draining" in p.log and "stopped" in p.log and "Traceback" not in p.log


@pytest.mark.slow
def test_serve_refuses_to_start_without_the_model(tmp_path: Path, tiny_repo: Path, processes: list[Process]) -> None:
    p = Process("--repository", str(tmp_path), "--port", "0", "--metrics-port", "0", "--http-port", "0")
    processes.append(p)
    assert p.wait() == 1
    assert f"the model repository {tmp_path} has no models" in p.log

    p = Process(
        "--repository", str(tiny_repo), "--model", "nope", "--port", "0", "--metrics-port", "0", "--http-port", "0"
    )
    processes.append(p)
    assert p.wait() == 1
    assert "model 'nope' is not in the repository" in p.log and "Traceback" not in p.log

    # one version's files at the repository's top (a SageMaker model.tar.gz of a version's folder) are said so
    bare = tmp_path / "bare"
    shutil.copytree(tiny_repo / "tiny" / "1", bare)
    p = Process("--repository", str(bare), "--port", "0", "--metrics-port", "0", "--http-port", "0")
    processes.append(p)
    assert p.wait() == 1
    assert "holds one model version's files at its top" in p.log and f"{bare}/<name>/1/" in p.log

    # a model's folder named as the repository (its versions at the top: `tar -C models/<name> .`) is said so,
    # where it was told to export a model into it
    p = Process("--repository", str(tiny_repo / "tiny"), "--port", "0", "--metrics-port", "0", "--http-port", "0")
    processes.append(p)
    assert p.wait() == 1
    assert f"{tiny_repo / 'tiny'} holds a model's versions (1) at its top" in p.log, p.log[-2000:]
    assert f"--repository {tiny_repo}" in p.log and "mhaserve export" not in p.log

    # a folder that is not there is said to be missing (the default, `models`, is relative to where one runs)
    p = Process("--repository", str(tmp_path / "nowhere"), "--port", "0", "--metrics-port", "0", "--http-port", "0")
    processes.append(p)
    assert p.wait() == 1
    assert f"the model repository {tmp_path / 'nowhere'} (no such folder) has no models" in p.log


@pytest.fixture(scope="module")
def server(tiny_repo: Path) -> Iterator[ServerThread]:
    # --no-auto-truncate, so that a long text is refused unless `encode --truncate` asks it cut
    settings = Settings(repository=tiny_repo, port=0, metrics_port=0, http_port=0, device="cpu", intra_op_threads=1)
    srv = ServerThread(dataclasses.replace(settings, auto_truncate=False))
    yield srv.ready()
    srv.stop()


def test_encode_prints_one_json_array_per_text(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["encode", "hello", "second text", "--address", server.address, "--no-normalize"]) == 0
    lines = capsys.readouterr().out.splitlines()
    vectors = np.array([json.loads(line) for line in lines])
    assert vectors.shape == (2, 32)
    expected = client.encode(server.address, ["hello", "second text"], normalize=False)
    np.testing.assert_allclose(vectors, [e.values for e in expected.embeddings], atol=1e-6)


def test_encode_summary_and_errors(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["encode", "hello", "--address", server.address, "--summary"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny version 1: 1 embedding of 32 dimensions")
    assert "norm 1.0000" in out and "'hello'" in out
    assert main(["encode", "a " * 200, "--address", server.address]) == 1
    assert "INVALID_ARGUMENT: input 0 is 202 tokens long" in capsys.readouterr().err
    assert main(["encode", "a " * 200, "--truncate", "--summary", "--address", server.address]) == 0
    assert "160 input tokens" in capsys.readouterr().out


def test_encode_no_truncate_has_a_long_text_refused_where_the_server_cuts_it(
    tiny_repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bug: encoder.v1's truncate could not say false (a proto3 bool), so against a server with
    --auto-truncate, the default, `encode` had no way to have a long text refused rather than cut."""
    settings = Settings(repository=tiny_repo, port=0, metrics_port=0, http_port=0, device="cpu", intra_op_threads=1)
    with ServerThread(settings).ready() as srv:
        assert main(["encode", "a " * 200, "--summary", "--address", srv.address]) == 0
        assert "160 input tokens" in capsys.readouterr().out
        assert main(["encode", "a " * 200, "--no-truncate", "--address", srv.address]) == 1
        assert "INVALID_ARGUMENT: input 0 is 202 tokens long" in capsys.readouterr().err


def test_encode_sends_no_more_texts_a_request_than_the_model_takes(
    tiny_repo: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug: against a model taking fewer inputs a request than --batch-size's 64 (docs/models.md's serving.json
    example takes 32), every file of more lines failed with "40 inputs in one request; the limit is 32", though
    GetModelInfo, which encode asks first, says the limit. Its requests are now that size at most."""
    settings = Settings(
        repository=tiny_repo, port=0, metrics_port=0, http_port=0, device="cpu", intra_op_threads=1,
        max_client_batch_size=5,
    )  # fmt: skip
    texts = [f"query number {i}" for i in range(12)]
    with ServerThread(settings).ready() as srv:
        expected = [
            e.values
            for start in range(0, 12, 5)
            for e in client.encode(srv.address, texts[start : start + 5]).embeddings
        ]
        for size in ([], ["--batch-size", "3"]):
            monkeypatch.setattr("sys.stdin", stdin("\n".join(texts) + "\n"))
            assert main(["encode", "-", "--address", srv.address, *size]) == 0
            out, err = capsys.readouterr()
            assert err == ""
            np.testing.assert_allclose([json.loads(line) for line in out.splitlines()], expected, atol=1e-6)


def test_encode_asks_for_dimensions_and_a_prompt(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    """The Encode request's `dimensions` and `prompt_name`, which the command could not send."""
    assert main(["encode", "hello", "second text", "--dimensions", "8", "--address", server.address]) == 0
    vectors = np.array([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    assert vectors.shape == (2, 8)
    expected = client.encode(server.address, ["hello", "second text"], dimensions=8)
    np.testing.assert_allclose(vectors, [e.values for e in expected.embeddings], atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # the tiny model has no prompts: the server's refusal, said as for any other
    assert main(["encode", "hello", "--prompt-name", "query", "--address", server.address]) == 1
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT: model 'tiny' has no prompt 'query': it has none" in err, err
    with pytest.raises(SystemExit) as e:
        main(["encode", "hello", "--dimensions", "0", "--address", server.address])
    assert e.value.code == 2 and "above 0" in capsys.readouterr().err


def test_encode_reads_stdin_and_refuses_bad_timeouts_and_keys(
    server: ServerThread, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", stdin("hello\n\nsecond text\n"))
    assert main(["encode", "-", "--address", server.address, "--no-normalize"]) == 0
    vectors = np.array([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    expected = client.encode(server.address, ["hello", "second text"], normalize=False)
    np.testing.assert_allclose(vectors, [e.values for e in expected.embeddings], atol=1e-6)
    monkeypatch.setattr("sys.stdin", stdin(""))
    assert main(["encode", "-", "--address", server.address]) == 2
    assert "no text on standard input" in capsys.readouterr().err
    # refused by argparse (exit 2) before any call: a negative timeout, a key gRPC metadata cannot carry
    bad_values = (
        (["--timeout", "-1"], "above 0"),
        (["--timeout", "abc"], "argument --timeout: invalid float value: 'abc'"),  # "invalid _seconds value" once
        (["--api-key", "clé"], "printable ASCII"),
        # grpcio fails every call whose deadline is that far (DEADLINE_EXCEEDED at once), blaming the server
        (["--timeout", "1e10"], "and at most 100000000"),
    )
    for bad, message in bad_values:
        with pytest.raises(SystemExit) as e:
            main(["encode", "hello", "--address", server.address, *bad])
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["health", "--address", server.address, "--timeout", "1e10"])
    assert e.value.code == 2 and "and at most 100000000" in capsys.readouterr().err
    # the longest a timeout may be still works
    assert main(["encode", "hello", "--address", server.address, "--timeout", "1e8"]) == 0
    assert main(["health", "--address", server.address, "--timeout", "1e8"]) == 0


def test_encode_prints_the_servers_float32_values_exactly(
    server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each value was rounded to 7 decimals: 1,123 of 1,152 differed from the server's float32 (a value of 1e-33
    printed as -0.0), where every other API answers them bit for bit. Each is printed as the shortest decimal that
    reads back as the same float32."""
    texts = ["hello", "The quick brown fox jumps over the lazy dog", "日本語のテキスト"]
    assert main(["encode", *texts, "--address", server.address, "--no-normalize"]) == 0
    lines = capsys.readouterr().out.splitlines()
    printed = np.array([json.loads(line) for line in lines], dtype=np.float32)
    np.testing.assert_array_equal(printed, client.vectors(client.encode(server.address, texts, normalize=False)))
    first = client.encode(server.address, texts[:1], normalize=False).embeddings[0].values
    assert lines[0] == "[" + ", ".join(str(np.float32(v)) for v in first) + "]"


def test_a_response_with_no_embeddings_prints_nothing() -> None:
    """A library caller's empty answer raised "cannot reshape array of size 0" once the values were read as float32."""
    assert client.vectors(pb.EncodeResponse()).shape == (0, 0)
    assert client.embeddings_json(pb.EncodeResponse()) == ""


def test_encode_splits_standard_input_at_line_ends_only(
    server: ServerThread, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """str.splitlines() split at a form feed, U+2028 and other characters too: 3 lines printed 5 embeddings, which
    no longer lined up with the lines. A Windows file's "\\r" before each "\\n" is no part of its text."""
    lines = ["page one\x0cpage two", "left\u2028right", "last\x1cline"]
    monkeypatch.setattr("sys.stdin", stdin(f"{lines[0]}\r\n{lines[1]}\n\n{lines[2]}\r\n"))
    assert main(["encode", "-", "--address", server.address, "--no-normalize"]) == 0
    vectors = np.array([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    expected = client.encode(server.address, lines, normalize=False)
    assert vectors.shape == (3, 32)
    np.testing.assert_allclose(vectors, [e.values for e in expected.embeddings], atol=1e-6)


@pytest.mark.parametrize(
    ("texts", "given", "where"),
    [
        ([b"fine", b"caf\xe9"], b"", "argument 2"),
        ([b"-"], b"fine\n\ncaf\xe9 au lait\n", "line 3 of standard input"),
    ],
    ids=["argument", "stdin"],
)
def test_encode_names_a_text_that_is_not_utf8(texts: list[bytes], given: bytes, where: str) -> None:
    """Latin-1 text, as an argument or a line, was a traceback ending in "UnicodeEncodeError: ... surrogates not
    allowed" (exit 1). A real process: its arguments and standard input come as bytes."""
    run = subprocess.run(
        [MHASERVE, "encode", *texts, "--address", f"127.0.0.1:{free_port()}"],
        input=given,
        capture_output=True,
        timeout=WAIT,
    )
    assert (run.returncode, run.stdout) == (2, b""), run.stderr
    assert run.stderr.decode() == f"mhaserve encode: error: {where} is not UTF-8 (byte 0xe9)\n"


@pytest.mark.parametrize(
    ("command", "where"),
    [
        ([b"encode", b"hi", b"--model", b"caf\xe9"], "--model"),
        ([b"encode", b"hi", b"--prompt-name", b"caf\xe9"], "--prompt-name"),
        ([b"health", b"--service", b"caf\xe9"], "--service"),
        ([b"health", b"--address", b"caf\xe9:1"], "--address"),
    ],
    ids=["model", "prompt-name", "service", "address"],
)
def test_an_option_that_is_not_utf8_is_a_usage_error(command: list[bytes], where: str) -> None:
    """Not only the texts: an option that is not UTF-8 went into the request and was a traceback ("surrogates not
    allowed", exit 1)."""
    run = subprocess.run([MHASERVE, *command], capture_output=True, timeout=WAIT)
    assert run.returncode == 2, run.stderr
    assert f"{where}: " in run.stderr.decode() and "is not UTF-8 (byte 0xe9)" in run.stderr.decode(), run.stderr


def test_encode_dimensions_past_what_a_request_carries_are_a_usage_error() -> None:
    """--dimensions 2147483648, past the request's int32 field, was a traceback ("Value out of range", exit 1)."""
    run = subprocess.run([MHASERVE, "encode", "hi", "--dimensions", "2147483648"], capture_output=True, timeout=WAIT)
    assert run.returncode == 2 and b"--dimensions" in run.stderr and b"Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("command", [["health"], ["encode", "hello"]])
def test_a_bad_key_in_the_variable_is_named_by_the_variable(
    command: list[str], server: ServerThread, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MHASERVE_API_KEY='bad key' was "argument --api-key: ...", of a flag never typed: argparse checks a default
    as the flag's value. The key itself is not shown."""
    monkeypatch.setenv("MHASERVE_API_KEY", "bad key")
    assert main([*command, "--address", server.address]) == 2
    message = "MHASERVE_API_KEY: an API key is printable ASCII without spaces"
    assert capsys.readouterr() == ("", f"mhaserve {command[0]}: error: {message}\n")
    # a flag beats its variable, which is then not read at all
    assert main([*command, "--address", server.address, "--api-key", "good-key"]) == 0
    monkeypatch.setenv("MHASERVE_API_KEY", "")  # empty is unset, as for serve
    assert main([*command, "--address", server.address]) == 0


def test_an_address_without_a_port_gets_the_servers_default(capsys: pytest.CaptureFixture[str]) -> None:
    """grpc's own default is 443: `--address 127.0.0.1` reached for a port nothing listens on."""
    from mhaserve.cli.main import build_parser

    parser = build_parser()
    for given, expected in [
        ("127.0.0.1", "127.0.0.1:50051"),
        ("localhost:6000", "localhost:6000"),
        ("[::1]", "[::1]:50051"),
        ("[::1]:6000", "[::1]:6000"),
        ("dns:///encoder.internal:50051", "dns:///encoder.internal:50051"),
    ]:
        assert parser.parse_args(["health", "--address", given]).address == expected
        assert parser.parse_args(["encode", "x", "--address", given]).address == expected
    # a URL (the HTTP API's, say) passed as a grpc target and failed at the call: "Misformatted domain name"
    url = "is a URL; the gRPC port is named HOST:PORT (127.0.0.1:19200)"
    for bad, message in [
        ("::1", "an IPv6 address goes in brackets"),
        ("host:port", "is not HOST:PORT"),
        ("http://127.0.0.1:19200", url),
        ("HTTPS://127.0.0.1:19200/", url),
    ]:
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["health", "--address", bad])
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("address", ["localhost:100587", "localhost:65536", "localhost:0", "[::1]:70000", "[::1]:0"])
def test_an_address_with_a_port_past_65535_or_0_is_refused(address: str, capsys: pytest.CaptureFixture[str]) -> None:
    """grpc takes the port modulo 65536: `--address host:100587` asked port 35051, where another server may
    answer SERVING."""
    from mhaserve.cli.main import build_parser

    for command in (["health"], ["encode", "x"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([*command, "--address", address])
        assert e.value.code == 2 and "a port is a number from 1 to 65535" in capsys.readouterr().err
    assert build_parser().parse_args(["health", "--address", "localhost:65535"]).address == "localhost:65535"


@pytest.mark.parametrize(
    "request_id",
    ["two\nlines", "x" * 20_000, "with space", "crochet]", "clé"],
    ids=["newline", "long", "space", "bracket", "accent"],
)
def test_a_request_id_the_server_would_not_take_is_refused(request_id: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A newline got grpc core's C log lines and "INTERNAL: Invalid metadata", 20,000 characters RESOURCE_EXHAUSTED;
    an id the server replaces with its own named nothing in its log."""
    from mhaserve.cli.main import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["encode", "x", "--request-id", request_id])
    assert e.value.code == 2 and "a request id is 1 to 128 letters, digits and ._:/+=@-" in capsys.readouterr().err


def test_a_request_id_the_server_takes_is_sent(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    request_id = "0af7651916cd43dd8448eb211c80319c:b7ad6b7169203331/" + "x" * 76  # 128 characters
    assert main(["encode", "hello", "--address", server.address, "--request-id", request_id, "--summary"]) == 0
    assert capsys.readouterr().out.startswith("tiny version 1: 1 embedding")


def test_encode_sends_many_texts_in_requests_the_server_takes(
    server: ServerThread, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mhaserve encode - < queries.txt` failed with "100 inputs in one request; the limit is 64" for a file of
    more lines than the server takes in one request; the output stays that of one request."""
    texts = [f"query number {i}" for i in range(100)]
    monkeypatch.setattr("sys.stdin", stdin("\n".join(texts) + "\n"))
    assert main(["encode", "-", "--address", server.address, "--no-normalize"]) == 0
    vectors = np.array([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    expected = [
        e.values
        for part in (texts[:50], texts[50:])
        for e in client.encode(server.address, part, normalize=False).embeddings
    ]
    np.testing.assert_allclose(vectors, expected, atol=1e-6)

    one = client.encode(server.address, texts[:7])
    assert main(["encode", *texts[:7], "--address", server.address, "--summary", "--batch-size", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"tiny version 1: 7 embeddings of 32 dimensions, {one.usage.input_tokens} input tokens")
    assert out.splitlines()[-1].startswith("[6] norm 1.0000") and "'query number 6'" in out

    # an error in a later request says which texts that request held: the server numbers its own inputs; and which
    # line the input it names came from (from 1, blank lines skipped: "input 6" was read as the 6th or 7th line)
    texts[70] = "a " * 200
    monkeypatch.setattr("sys.stdin", stdin("\n\n".join(texts)))
    assert main(["encode", "-", "--address", server.address]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(
        "mhaserve encode: error: line 141 of standard input: the request of texts 64 to 99: INVALID_ARGUMENT: input 6 "
        "is 202"
    ), err
    with pytest.raises(SystemExit) as e:
        main(["encode", "x", "--batch-size", "0"])
    assert e.value.code == 2


ENCODE = client.encode


@pytest.fixture
def polled(tmp_path: Path) -> Iterator[tuple[ServerThread, Path]]:
    """A server of model m, version 1, that polls its repository: a version published is served and the one
    before it retired within a poll."""
    export(tmp_path, "m", 1, seed=1)
    srv = ServerThread(bare_settings(tmp_path, "m", model_control="poll", repository_poll_s=0.05))
    yield srv.ready(), tmp_path
    srv.stop()


def _retired(address: str, version: int) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.EncoderServiceStub(channel).Encode(
                pb.EncodeRequest(texts=["x"], model="m", model_version=version), timeout=WAIT
            )
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.NOT_FOUND
    return False


def _replace_versions(monkeypatch: pytest.MonkeyPatch, srv: ServerThread, repo: Path, times: int = 1) -> list[str]:
    """client.encode made to publish a new version of m after each of its first `times` answers and wait until the
    version that answered is retired, as a deployment between two of encode's requests would. Returns the list
    of the `model` each request named."""
    asked: list[str] = []
    answered = 0

    def encode(address: str, texts: list[str], **kw: Any) -> pb.EncodeResponse:
        nonlocal answered
        asked.append(kw["model"])
        response = ENCODE(address, texts, **kw)
        if answered < times:
            answered += 1
            version = response.model_version
            publish_copy(repo, "m", 1, version + 1, seed=version + 1)
            wait_until(lambda: _retired(srv.address, version), f"version {version} retired")
        return response

    monkeypatch.setattr(client, "encode", encode)
    return asked


def test_encode_starts_again_with_the_new_version_when_the_one_it_pinned_is_retired(
    polled: tuple[ServerThread, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug: encode pins name:version after its first request, and a version published meanwhile (the one
    pinned retired) failed the next request with NOT_FOUND: exit 1, nothing printed, every vector thrown away,
    though the user named no version. It starts again from the first text with the version served now."""
    srv, repo = polled
    texts = [f"text number {i}" for i in range(7)]
    asked = _replace_versions(monkeypatch, srv, repo)
    monkeypatch.setattr("sys.stdin", stdin("\n".join(texts) + "\n"))
    command = ["encode", "-", "--address", srv.address, "--model", "m", "--batch-size", "3"]
    assert main([*command, "--summary"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("m version 2: 7 embeddings of 32 dimensions"), out
    assert err == (
        "mhaserve encode: model m version 1 went out of service while encoding (model 'm' version '1' is not served "
        "here (serving version 2)): encoding the 7 texts again, from the start, with the version served now\n"
    )
    assert asked == ["m:1", "m:1", "m:2", "m:2", "m:2"]  # pinned from the first, by GetModelInfo

    # the vectors printed are all version 3's, once 2 is retired after the first request in its turn
    _replace_versions(monkeypatch, srv, repo)
    monkeypatch.setattr("sys.stdin", stdin("\n".join(texts) + "\n"))
    assert main(command) == 0
    out, err = capsys.readouterr()
    assert "version 2 went out of service" in err
    vectors = np.array([json.loads(line) for line in out.splitlines()])
    np.testing.assert_allclose(vectors, client.vectors(ENCODE(srv.address, texts, model="m:3")), atol=1e-6)


def test_encode_of_a_version_named_is_not_started_again_and_a_version_that_keeps_changing_fails(
    polled: tuple[ServerThread, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version the user named is what they asked for: its retirement is the error, as before."""
    srv, repo = polled
    texts = "\n".join(f"text number {i}" for i in range(7))
    asked = _replace_versions(monkeypatch, srv, repo)
    monkeypatch.setattr("sys.stdin", stdin(texts))
    assert main(["encode", "-", "--address", srv.address, "--model", "m:1", "--batch-size", "3"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and asked == ["m:1", "m:1"]
    assert err == (
        "mhaserve encode: error: the request of texts 3 to 5: NOT_FOUND: model 'm' version '1' is not served here "
        "(serving version 2)\n"
    )

    # a new version after every answer: three starts again, then the error, which says the versions kept changing
    asked = _replace_versions(monkeypatch, srv, repo, times=4)
    monkeypatch.setattr("sys.stdin", stdin(texts))
    assert main(["encode", "-", "--address", srv.address, "--batch-size", "3"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and asked == ["m:2", "m:2", "m:3", "m:3", "m:4", "m:4", "m:5", "m:5"]
    *again, last = err.splitlines()
    assert [line.split(" went out of service")[0] for line in again] == [
        f"mhaserve encode: model m version {v}" for v in (2, 3, 4)
    ]
    assert last == (
        "mhaserve encode: error: the request of texts 3 to 5: NOT_FOUND: model 'm' version '5' is not served here "
        "(serving version 6); the model's version changed 4 times while encoding: run it again once new versions "
        "stop coming"
    ), last


def test_encode_starts_again_when_its_version_is_loaded_again_from_changed_files(
    polled: tuple[ServerThread, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version replaced in place (`export --overwrite` of the version served) is loaded again under the same
    number: encode, pinned to the number, went on, and printed one model's vectors for the texts before and
    another's after, exit 0 and no word (a review's finding: 4,898 rows of one, 13,102 of the other). The copy
    is checked after the last request, and the texts encoded again where it changed; a version the user named
    too, as it is still the version asked for."""
    srv, repo = polled
    texts = [f"text number {i}" for i in range(7)]
    sha = client.model_info(srv.address, model="m:1").sha256
    replaced: list[Path] = []

    def encode(address: str, batch: list[str], **kw: Any) -> pb.EncodeResponse:
        response = ENCODE(address, batch, **kw)
        if not replaced:  # after the first answer: version 1's files replaced, under the same number
            replaced.append(export(repo / ".src", "m", 1, seed=len(replaced) + 7))
            os.rename(repo / "m" / "1", repo / ".old")
            os.rename(replaced[0], repo / "m" / "1")
            wait_until(lambda: client.model_info(address, model="m:1").sha256 != sha, "version 1 loaded again")
        return response

    monkeypatch.setattr(client, "encode", encode)
    monkeypatch.setattr("sys.stdin", stdin("\n".join(texts) + "\n"))
    assert main(["encode", "-", "--address", srv.address, "--model", "m:1", "--batch-size", "3"]) == 0
    out, err = capsys.readouterr()
    assert err == (
        "mhaserve encode: model m version 1 was loaded again while encoding (from changed files, or with other "
        "settings): encoding the 7 texts again, from the start, with the version served now\n"
    )
    vectors = np.array([json.loads(line) for line in out.splitlines()])
    np.testing.assert_allclose(vectors, client.vectors(ENCODE(srv.address, texts, model="m:1")), atol=1e-6)


def test_encode_into_a_pipe_closed_early_is_quiet(server: ServerThread) -> None:
    """`mhaserve encode ... | head -1` printed a BrokenPipeError traceback under head's line."""
    texts = "\n".join(f"text number {i}" for i in range(400))  # more output than a pipe holds (64 KiB)
    proc = subprocess.Popen(
        [MHASERVE, "encode", "-", "--address", server.address],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(texts.encode())
    proc.stdin.close()
    assert proc.stdout.readline().startswith(b"[")
    proc.stdout.close()  # as head does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=WAIT) == 141 and err == "", err


@pytest.mark.parametrize("out", ["full", "closed"])
def test_encode_whose_output_cannot_be_written_says_so_in_one_line(server: ServerThread, out: str) -> None:
    """`encode - < corpus > vectors.jsonl` on a full disk ended in a traceback; with its standard output closed
    it printed nothing and exited 0, the embeddings lost without a word."""
    with open("/dev/full" if out == "full" else os.devnull, "w") as stdout:
        proc = subprocess.run(
            [MHASERVE, "encode", "hello", "--address", server.address],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=WAIT,
            preexec_fn=(lambda: os.close(1)) if out == "closed" else None,  # noqa: PLW1509
        )
    said = "No space left on device" if out == "full" else "standard output is closed"
    assert proc.returncode == 1 and proc.stderr.strip() == f"mhaserve encode: error: {said}", proc.stderr
    if out == "full":  # health's answer (export's and import's entry) alike
        with open("/dev/full", "w") as stdout:
            proc = subprocess.run(
                [MHASERVE, "health", "--address", server.address],
                stdout=stdout,
                stderr=subprocess.PIPE,
                text=True,
                timeout=WAIT,
            )
        assert proc.returncode == 1 and proc.stderr.strip() == f"mhaserve health: error: {said}", proc.stderr


@pytest.mark.parametrize("out", ["full", "closed"])
def test_an_export_whose_path_cannot_be_printed_has_still_published(tmp_path: Path, out: str) -> None:
    """The version was published, but the path it printed last could not be written: exit 1, "No space left on
    device" (the user looked at the repository's disk), and a script that retries a failed export published a
    second version. README: export exits 0 once it has published. It does, and says what it could not print."""
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "16", "--max-positions", "16"]
    with open("/dev/full" if out == "full" else os.devnull, "w") as stdout:
        proc = subprocess.run(
            [MHASERVE, "export", "--repository", str(tmp_path), "--source", "random", *sizes, "--vocab-size", "200",
             "--name", "c"],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            preexec_fn=(lambda: os.close(1)) if out == "closed" else None,  # noqa: PLW1509
        )  # fmt: skip
    said = "No space left on device" if out == "full" else "standard output is closed"
    assert proc.returncode == 0, proc.stderr
    assert "--overwrite" not in proc.stderr
    assert proc.stderr.strip().endswith(f"mhaserve export: warning: published {tmp_path / 'c' / '1'}; its path could "
                                        f"not be printed: {said}"), proc.stderr  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["1"]


def test_export_overwrite_without_a_version_says_it_replaces_nothing(tmp_path: Path) -> None:
    """--overwrite without --version published the next version, as without it, and said nothing."""
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ffn", "16", "--max-positions", "16"]
    for _ in range(2):
        proc = subprocess.run(
            [MHASERVE, "export", "--repository", str(tmp_path), "--source", "random", *sizes, "--vocab-size", "200",
             "--name", "c", "--overwrite"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    assert "warning: --overwrite replaces the version --version names; without --version a new version is " in (
        proc.stderr
    )
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["1", "2"]


def test_encode_from_a_closed_standard_input_is_a_usage_error() -> None:
    proc = subprocess.run(
        [MHASERVE, "encode", "-", "--address", "127.0.0.1:1"],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=WAIT,
        preexec_fn=lambda: os.close(0),  # noqa: PLW1509
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "mhaserve encode: error: standard input is closed", proc.stderr


def test_ctrl_c_while_the_command_line_is_read_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in a command's first 0.3 s, while the parser is built (its modules imported), was a traceback."""
    from mhaserve.cli import main as cli

    def interrupted() -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["health", "--address", "127.0.0.1:1"]) == 130
    assert capsys.readouterr().err == "mhaserve health: interrupted\n"
    assert main(["-v"]) == 130
    assert capsys.readouterr().err == "mhaserve: interrupted\n"


class CountingForwarder:
    """A TCP forwarder to a server that counts the connections clients open through it."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:  # closed
                return
            self.connections += 1
            far = socket.create_connection(self.target)
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def test_encode_sends_its_requests_over_one_connection(
    server: ServerThread, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`mhaserve encode - < queries.txt` opened a connection (a handshake, TLS's too) for every request."""
    forwarder = CountingForwarder(server.address)
    try:
        texts = [f"query number {i}" for i in range(10)]
        monkeypatch.setattr("sys.stdin", stdin("\n".join(texts) + "\n"))
        assert main(["encode", "-", "--address", forwarder.address, "--batch-size", "3"]) == 0
        assert len(capsys.readouterr().out.splitlines()) == 10
        assert forwarder.connections == 1
    finally:
        forwarder.close()


def test_export_and_import_write_where_serve_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`mhaserve export` wrote ./models while `mhaserve serve` under the same environment read
    MHASERVE_REPOSITORY's folder."""
    from mhaserve.cli.main import build_parser

    importing = ["import", "--onnx", "m.onnx", "--tokenizer", "t.json", "--name", "m"]
    monkeypatch.setenv("MHASERVE_REPOSITORY", str(tmp_path))
    for command in (["export"], importing):
        assert build_parser().parse_args(command).repository == str(tmp_path)
        assert build_parser().parse_args([*command, "--repository", "elsewhere"]).repository == "elsewhere"
    monkeypatch.setenv("MHASERVE_REPOSITORY", "")  # empty is unset, as for serve
    assert build_parser().parse_args(["export"]).repository == "models"
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "MHASERVE_REPOSITORY" in capsys.readouterr().out


def test_health_exit_status(tiny_repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    srv = ServerThread(
        Settings(repository=tiny_repo, port=0, metrics_port=0, http_port=0, device="cpu", intra_op_threads=1)
    )
    try:
        srv.ready()
        assert main(["health", "--address", srv.address]) == 0
        assert capsys.readouterr().out.strip() == "SERVING"
        assert main(["health", "--address", srv.address, "--service", "nope"]) == 1
        assert "NOT_FOUND: the server has no service 'nope'" in capsys.readouterr().err
        srv.call(srv.server.drain())
        assert main(["health", "--address", srv.address]) == 1
        assert capsys.readouterr().out.strip() == "NOT_SERVING"
        address = srv.address
    finally:
        srv.stop()
    assert main(["health", "--address", address, "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err


def test_serve_keeps_onnx_runtimes_telemetry_off(tiny_repo: Path, tmp_path: Path) -> None:
    """onnxruntime's Linux wheels send usage events to Microsoft and write a device id under ~/.cache unless
    ORT_DISABLE_TELEMETRY is set before the library starts; the CLI sets it (a user's own value wins)."""
    from mhaserve.testing.process import ServerProcess

    home = tmp_path / "home"
    home.mkdir()
    flags = ["--repository", str(tiny_repo), "--model", "tiny", "--device", "cpu", "--port", "0", "--metrics-port", "0",
             "--http-port", "0"]  # fmt: skip
    # Not inherited from this process: a test that ran main() here has set it in this process's environment.
    env = {k: v for k, v in os.environ.items() if k not in ("ORT_DISABLE_TELEMETRY", "XDG_CACHE_HOME")}
    env["HOME"] = str(home)
    with (
        ServerProcess(flags, tmp_path / "serve.log", env=env) as proc,
        grpc.insecure_channel(proc.wait_serving()) as ch,
    ):
        reply = pb_grpc.EncoderServiceStub(ch).Encode(pb.EncodeRequest(texts=["hello"]), timeout=WAIT)
        assert len(reply.embeddings) == 1
    assert not (home / ".cache" / "Microsoft").exists(), sorted(str(p) for p in home.rglob("*"))


def test_random_sizes_are_refused_by_their_flags_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The model config's own names (d_model, n_heads) in a message about flags (--d-model, --heads), with
    MiniLM's 12 heads as a default the help did not show."""
    assert main(["export", "--source", "random", "--repository", str(tmp_path), "--d-model", "64"]) == 2
    assert "error: --d-model 64 is not divisible by --heads 12" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    assert "--heads HEADS         attention heads (default 12)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--layers", "0"], "--layers must be positive, got 0"),
        (["--heads", "0"], "--heads must be positive, got 0"),
        (["--max-positions", "2"], "--max-positions must be at least 3, got 2"),
        (["--max-seq-len", "999"], "--max-seq-len 999 must be in 2..--max-positions (512)"),
        # [CLS] and [SEP] alone fill it: a model that refused every text was published
        (["--max-seq-len", "1"], "--max-seq-len must be >= 2 (special tokens included), got 1"),
        (["--max-positions", "16", "--max-seq-len", "20"], "--max-seq-len 20 must be in 2..--max-positions (16)"),
        (["--vocab-size", "3"], "a synthetic tokenizer needs --vocab-size >= 109, got 3"),
    ],
)
def test_random_sizes_no_model_can_have_are_usage_errors(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They exited 1, the code of a failed parity gate, where every other bad flag of export exits 2: a script
    could not tell them apart. One line naming the flag, and nothing written."""
    repository = tmp_path / "models"
    assert main(["export", "--source", "random", "--repository", str(repository), "--name", "q", *flags]) == 2
    assert capsys.readouterr().err == f"mhaserve export: error: {message}\n"
    assert not repository.exists()


def test_a_random_size_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """The sizes are checked by the model's config alone (no torch): a usage error is one where the export
    extra is not installed too, and it does not wait for torch to load."""
    code = (
        "import sys; from mhaserve.cli.main import main; "
        "rc = main(['export', '--source', 'random', '--repository', sys.argv[1], '--layers', '0']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr


@pytest.mark.parametrize("length", ["1", "0"])
def test_import_refuses_a_max_seq_len_below_2_as_a_usage_error(
    length: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`import --max-seq-len 1` published a model that refused every text ([CLS] and [SEP] fill it), as
    `export --max-seq-len 1` did; serving.json's max_length below 2 is refused too."""
    argv = ["import", "--onnx", "m.onnx", "--tokenizer", "t.json", "--name", "m", "--repository", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--max-seq-len", length])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --max-seq-len: must be a whole number >= 2 (special tokens included), got {length!r}" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mhaserve {version('mhaserve')}"


def test_a_serve_run_in_process_leaves_its_log_on_the_stderr_of_the_moment(
    root_logging: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`main(["serve", ...])` called in process (as tests/cli does) configures the server's logging, and its
    handler outlived the stderr it was made with: CI's "Logging error" lines came from it."""
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    # a repository with no model: logging is configured, then the server fails to serve
    assert main(["serve", "--repository", str(tmp_path), "--port", "0", "--http-port", "0", "--metrics-port", "0"]) != 0
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    first.close()
    logging.getLogger("mhaserve.test").info("after")
    assert "Logging error" not in second.getvalue()
    assert second.getvalue().rstrip().endswith("INFO mhaserve.test [-] after")
