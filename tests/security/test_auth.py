"""API keys: every method but the open ones wants `authorization: Bearer <key>`; keys never show anywhere."""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import hmac
import logging
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mhaserve.cli.main import main
from mhaserve.cli.options import build
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2 as kpb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as kpb_grpc
from mhaserve.proto.tei.v1 import tei_pb2 as tpb
from mhaserve.proto.tei.v1 import tei_pb2_grpc as tpb_grpc
from mhaserve.service import auth
from mhaserve.service.context import RequestIdFilter
from mhaserve.service.http import middleware
from mhaserve.service.kserve import servicer as kserve
from mhaserve.service.rpc import auth as rpc_auth
from mhaserve.service.rpc import methods
from mhaserve.service.rpc.lean import frames as f
from mhaserve.service.server import StartupError
from mhaserve.service.settings import ApiKeys, Settings, SettingsError
from mhaserve.testing.http import request
from mhaserve.testing.loopback import WAIT, free_port, wait_until
from mhaserve.testing.server import ServerThread
from tests.service.raw_h2 import Frame, answers, call_block, read_until

FILE_KEY = "file-key-6f1c2b9e"
ENV_KEY = "env-key-0d4a7c31"
KEYS = (FILE_KEY, ENV_KEY)


def bearer(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# mhaserve API keys\n\n  {FILE_KEY}  \n# retired: old-key-123\n")
    return path


def _keyed(tiny_repo: Path, keys_file: Path, grpc_front: str, **extra: Any) -> Settings:
    """A server of the tiny model whose callers need the keys of `keys_file`."""
    return Settings(
        grpc_front=grpc_front,
        repository=tiny_repo,
        model=("tiny",),
        port=0,
        metrics_port=0,
        http_port=free_port(),
        device="cpu",
        intra_op_threads=1,
        api_keys_file=keys_file,
        **extra,
    )


@pytest.fixture(scope="module")
def secured(tiny_repo: Path, keys_file: Path, grpc_front: str) -> Settings:
    return _keyed(tiny_repo, keys_file, grpc_front, api_keys=ApiKeys((ENV_KEY,)))


@pytest.fixture(scope="module")
def server(secured: Settings) -> Iterator[ServerThread]:
    with ServerThread(secured) as srv:
        yield srv.ready()


@pytest.fixture
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with server.channel() as ch:
        yield ch


def calls(channel: grpc.Channel) -> dict[str, Callable[[Any], Any]]:
    """One call of every kind the model APIs have, each taking the metadata to send."""
    enc = pb_grpc.EncoderServiceStub(channel)
    inf = kpb_grpc.GRPCInferenceServiceStub(channel)
    tei_embed = tpb_grpc.EmbedStub(channel)
    return {
        "Encode": lambda md: enc.Encode(pb.EncodeRequest(texts=["hi"]), metadata=md, timeout=WAIT),
        "EncodeStream": lambda md: list(
            enc.EncodeStream(iter([pb.EncodeRequest(texts=["hi"])]), metadata=md, timeout=WAIT)
        ),
        "GetModelInfo": lambda md: enc.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=WAIT),
        "ServerMetadata": lambda md: inf.ServerMetadata(kpb.ServerMetadataRequest(), metadata=md, timeout=WAIT),
        "ModelMetadata": lambda md: inf.ModelMetadata(kpb.ModelMetadataRequest(name="tiny"), metadata=md, timeout=WAIT),
        "ModelStreamInfer": lambda md: list(
            inf.ModelStreamInfer(iter([kpb.ModelInferRequest(model_name="tiny")]), metadata=md, timeout=WAIT)
        ),
        # text-embeddings-inference's gRPC API
        "tei.v1 Embed": lambda md: tei_embed.Embed(tpb.EmbedRequest(inputs="hi"), metadata=md, timeout=WAIT),
        "tei.v1 EmbedStream": lambda md: list(
            tei_embed.EmbedStream(iter([tpb.EmbedRequest(inputs="hi")]), metadata=md, timeout=WAIT)
        ),
        "tei.v1 Info": lambda md: tpb_grpc.InfoStub(channel).Info(tpb.InfoRequest(), metadata=md, timeout=WAIT),
    }


WRONG = {
    "none": None,
    "unknown key": bearer("not-a-key"),
    "a prefix of a key": bearer(FILE_KEY[:-1]),
    "a key and more": bearer(FILE_KEY + "x"),
    "basic scheme": (("authorization", f"Basic {FILE_KEY}"),),
    "no scheme": (("authorization", FILE_KEY),),
    "empty bearer": (("authorization", "Bearer "),),
    "two headers": (("authorization", f"Bearer {FILE_KEY}"), ("authorization", "Bearer x")),
}


@pytest.mark.parametrize("wrong", WRONG)
def test_missing_or_wrong_keys_are_unauthenticated_for_every_kind_of_call(
    server: ServerThread, channel: grpc.Channel, wrong: str, caplog: pytest.LogCaptureFixture
) -> None:
    before = server.counted_all("UNAUTHENTICATED")
    observed = server.gauge("mhaserve_request_duration_seconds_count")
    with caplog.at_level(logging.DEBUG):
        for name, call in calls(channel).items():
            with pytest.raises(grpc.RpcError) as e:
                call(WRONG[wrong])
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "missing or invalid API key" in e.value.details()
            assert not any(k in e.value.details() for k in KEYS)
    assert server.counted_all("UNAUTHENTICATED") - before == len(calls(channel))
    # and timed, as every answered call is: the histogram's _count agrees with the counter
    assert server.gauge("mhaserve_request_duration_seconds_count") - observed == len(calls(channel))
    assert not any(k[:8] in record.getMessage() for record in caplog.records for k in KEYS)
    assert server.depth() == 0


def test_a_refused_call_is_logged_with_its_request_id_and_gets_it_back(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    """As on the HTTP port: once the refusal's log line had no request id ("-"), and the client none back."""
    stub = pb_grpc.EncoderServiceStub(channel)
    caplog.handler.addFilter(RequestIdFilter())  # what the server's log handler does: the id on each record
    rpc_auth.REFUSALS.reset()  # the lines of the tests before: counted from here
    with caplog.at_level(logging.INFO, logger="mhaserve.service.rpc.auth"):
        with pytest.raises(grpc.RpcError) as e:
            stub.Encode(pb.EncodeRequest(texts=["x"]), metadata=(("x-request-id", "client-7f3a"),), timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert ("x-request-id", "client-7f3a") in tuple(e.value.trailing_metadata())
        with pytest.raises(grpc.RpcError) as e:  # none sent: one made up, and sent back
            stub.Encode(pb.EncodeRequest(texts=["x"]), timeout=WAIT)
        made_up = dict(e.value.trailing_metadata())["x-request-id"]
    refused = [r for r in caplog.records if r.getMessage().startswith("refused /encoder.v1.EncoderService/Encode")]
    assert [getattr(r, "request_id", None) for r in refused] == ["client-7f3a", made_up]


def test_a_client_refused_in_a_loop_is_logged_at_most_ten_lines_a_second_and_counted_whole(
    server: ServerThread, channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    """A client with a wrong key in a loop wrote a line for each call, 9,000 a second (the Locust helper's run). Now
    at most REFUSAL_LINES_A_SECOND a second on each port, the next saying how many were left out; the metrics count
    every call."""
    stub = pb_grpc.EncoderServiceStub(channel)
    for throttle in (rpc_auth.REFUSALS, middleware.REFUSALS):
        throttle.reset()
    before = server.counted_all("UNAUTHENTICATED")
    with caplog.at_level(logging.INFO, logger="mhaserve.service"):
        for _ in range(60):
            with pytest.raises(grpc.RpcError):
                stub.Encode(pb.EncodeRequest(texts=["x"]), timeout=WAIT)
            assert request("POST", server.http_url + "/v1/embeddings", {"input": "x"}).status == 401
        time.sleep(1.1)  # a new second, whose first line says how many of the last were left out
        with pytest.raises(grpc.RpcError):
            stub.Encode(pb.EncodeRequest(texts=["x"]), timeout=WAIT)
        assert request("POST", server.http_url + "/v1/embeddings", {"input": "x"}).status == 401
    # counted after the answer is written: wait for the last
    wait_until(lambda: server.counted_all("UNAUTHENTICATED") - before == 122, "every refused call counted")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    for port in ("refused /", "refused POST"):
        written = [line for line in lines if line.startswith(port)]
        left_out = sum(int(n) for line in written for n in re.findall(r"\((\d+) more since the last such line", line))
        # 60 calls take well under a second here, and several on a slow machine: some were left out, and said
        assert len(written) < 61 and len(written) + left_out == 61, lines


def test_every_configured_key_is_let_in(server: ServerThread, channel: grpc.Channel) -> None:
    for key in KEYS:
        for header in (f"Bearer {key}", f"bearer   {key} "):
            results = {name: call((("authorization", header),)) for name, call in calls(channel).items()}
            assert len(results["Encode"].embeddings) == 1
            assert results["GetModelInfo"].name == "tiny"
            assert results["ServerMetadata"].name == "mhaserve"


def test_health_and_reflection_stay_open(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=WAIT).status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=WAIT)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    listed_health = health.List(health_pb2.HealthListRequest(), timeout=WAIT).statuses
    assert listed_health[""].status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    (listed,) = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=WAIT
    )
    assert "encoder.v1.EncoderService" in {s.name for s in listed.list_services_response.service}
    # the Open Inference Protocol's server probes, as its REST /v2/health/live and /ready
    inf = kpb_grpc.GRPCInferenceServiceStub(channel)
    assert inf.ServerLive(kpb.ServerLiveRequest(), timeout=WAIT).live
    assert inf.ServerReady(kpb.ServerReadyRequest(), timeout=WAIT).ready


def test_open_methods_are_configurable(secured: Settings, caplog: pytest.LogCaptureFixture) -> None:
    settings = dataclasses.replace(secured, http_port=0, open_methods=("/inference.GRPCInferenceService/*",))
    with caplog.at_level(logging.INFO), ServerThread(settings) as srv, srv.channel() as channel:
        srv.ready()
        # the log says what the service's /* leaves closed (test_the_repository_api_wants_an_admin_key)
        assert any(
            r.getMessage().endswith(
                "open without a key: /inference.GRPCInferenceService/* (but the repository API, which wants an "
                "admin key)"
            )
            for r in caplog.records
        )
        inf = kpb_grpc.GRPCInferenceServiceStub(channel)
        assert inf.ServerLive(kpb.ServerLiveRequest(), timeout=WAIT).live
        assert inf.ModelMetadata(kpb.ModelMetadataRequest(name="tiny"), timeout=WAIT).name == "tiny"
        with pytest.raises(grpc.RpcError) as e:  # no longer open
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=["x"]), timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_without_keys_nothing_is_asked_and_the_log_says_so(tiny_repo: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(repository=tiny_repo, port=0, metrics_port=0, http_port=0, device="cpu", intra_op_threads=1)
    with caplog.at_level(logging.INFO), ServerThread(settings) as srv, srv.channel() as channel:
        srv.ready()
        assert pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=["x"]), timeout=WAIT).embeddings
    assert any("API keys: none configured; every method and route is open" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", [",", " ", " , ,"])
def test_a_keys_variable_that_names_no_key_is_refused(value: str) -> None:
    """Read as no keys, a secret that rendered as separators served everyone, and nothing said so."""
    for variable in ("MHASERVE_API_KEYS", "MHASERVE_ADMIN_KEYS"):
        with pytest.raises(SettingsError, match=f"^{variable} is not valid: it names no key$"):  # no --flag
            build({}, env={variable: value})


def test_keys_never_show_in_settings_or_the_log(
    secured: Settings, keys_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shown = repr(secured) + str(secured) + repr(build({}, env={"MHASERVE_API_KEYS": f"{ENV_KEY}, second-key"}))
    assert ENV_KEY not in shown and "second-key" not in shown and "<2 masked>" in shown
    with caplog.at_level(logging.DEBUG):
        srv = ServerThread(dataclasses.replace(secured, http_port=0))
        try:
            srv.ready()
        finally:
            srv.stop()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "API keys required (2 configured, 0 admin)" in text
    assert not any(k in text for k in KEYS)


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = auth.KeyRing(["a-key", "b-key", "c-key"])
    compared: list[bool] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        compared.append(real(a, b))
        return compared[-1]

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented, expected in (("a-key", True), ("c-key", True), ("nope", False), ("", False), ("a" * 10000, False)):
        compared.clear()
        assert ring.accepts(presented) is expected
        assert len(compared) == 3  # no early exit on the first match
    assert "a-key" not in repr(ring)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("# only a comment\n\n", "holds no key"),
        ("good-key\nbad key with spaces\n", "line 2: an API key must be printable ASCII"),
        ("ключ\n", "line 1: an API key must be printable ASCII"),
        # read as a key with spaces: "an API key must be printable ASCII without spaces", where --help said
        # "'#' comments"
        ("good-key\nbad-key  # the CI's\n", "line 2: a '#' comment must be on a line of its own"),
    ],
)
def test_a_bad_keys_file_stops_the_server_without_showing_keys(
    tiny_repo: Path, tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "keys"
    path.write_text(content)
    settings = Settings(repository=tiny_repo, port=0, metrics_port=0, http_port=0, device="cpu", api_keys_file=path)
    with pytest.raises(StartupError, match=message) as e:
        ServerThread(settings)
    assert "bad key" not in str(e.value) and "ключ" not in str(e.value) and "good-key" not in str(e.value)


def test_a_keys_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """Saved by a Windows editor as "UTF-8 with BOM": the mark was read as the first key's, which stopped the
    server with "line 1: an API key must be printable ASCII" and no hint."""
    path = tmp_path / "keys"
    path.write_bytes(codecs.BOM_UTF8 + b"first-key\r\n# a comment\r\nsecond-key\r\n")
    assert auth.read_keys_file(path) == ["first-key", "second-key"]
    path.write_bytes(codecs.BOM_UTF8 + b"# only a comment\n")
    with pytest.raises(auth.AuthError, match="holds no key"):
        auth.read_keys_file(path)


def test_a_missing_keys_file_stops_the_server(tiny_repo: Path, tmp_path: Path) -> None:
    settings = Settings(repository=tiny_repo, port=0, metrics_port=0, http_port=0, api_keys_file=tmp_path / "nope")
    with pytest.raises(StartupError, match="cannot read --api-keys-file"):
        ServerThread(settings)
    # the admin keys' file is named by its own flag (once as --api-keys-file, which was not given)
    settings = dataclasses.replace(settings, api_keys_file=None, admin_keys_file=tmp_path / "admin")
    with pytest.raises(StartupError, match="cannot read --admin-keys-file"):
        ServerThread(settings)
    (tmp_path / "admin").write_text("# none yet\n")
    with pytest.raises(StartupError, match="--admin-keys-file .* holds no key"):
        ServerThread(settings)


def test_bad_open_methods_are_refused_by_name() -> None:
    with pytest.raises(SettingsError, match="MHASERVE_OPEN_METHODS: 'Check' is not a full method name"):
        build({}, env={"MHASERVE_OPEN_METHODS": "Check"})
    assert build({"open_methods": ()}, env={}).open_methods == ()
    # through the environment an empty value means unset (the default); "none" closes every method
    assert build({}, env={"MHASERVE_OPEN_METHODS": ""}).open_methods == auth.OPEN_METHODS
    assert build({}, env={"MHASERVE_OPEN_METHODS": "none"}).open_methods == ()


@pytest.mark.parametrize(
    ("method", "why"),
    [
        # the admin check overrode it: still refused without an admin key, while the log called it open
        (kserve.REPOSITORY_METHODS[0], "is the repository API's, which always wants an admin key"),
        # opened nothing, and as the list replaced the defaults, real probes were refused
        (
            "/grpc.health.v1.Health/check",
            r"is no method of this server; did you mean /grpc\.health\.v1\.Health/Check\?",
        ),
        ("/grpc.health.v1.Helth/*", r"is no method of this server; did you mean /grpc\.health\.v1\.Health/\*\?"),
        ("/*/*", "is no method of this server$"),
    ],
)
def test_open_methods_that_would_open_nothing_are_refused_by_name(method: str, why: str) -> None:
    with pytest.raises(SettingsError, match=f"^--open-methods: {re.escape(repr(method))} {why}"):
        build({"open_methods": (auth.OPEN_METHODS[0], method)}, env={})
    with pytest.raises(SettingsError, match=f"^MHASERVE_OPEN_METHODS: {re.escape(repr(method))} {why}"):
        build({}, env={"MHASERVE_OPEN_METHODS": method})


def test_every_method_the_server_serves_can_be_opened(server: ServerThread, channel: grpc.Channel) -> None:
    """What --open-methods is checked against is what the port serves: the services reflection lists (methods.py
    reads their methods from the same descriptors), and each method, or its service, may be named."""
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    (listed,) = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=WAIT
    )
    served = {s.name for s in listed.list_services_response.service}
    assert served == {m[1:].rpartition("/")[0] for m in methods.METHODS}
    openable = [m for m in methods.METHODS if m not in kserve.REPOSITORY_METHODS]
    wildcards = [f"/{service}/*" for service in served]
    assert build({"open_methods": (*openable, *wildcards)}, env={}).open_methods == (*openable, *wildcards)


def test_the_cli_sends_the_key_from_its_flag_or_its_variable(
    server: ServerThread, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["encode", "hello", "--address", server.address]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(["encode", "hello", "--summary", "--address", server.address, "--api-key", FILE_KEY]) == 0
    assert "1 embedding of" in capsys.readouterr().out
    monkeypatch.setenv("MHASERVE_API_KEY", ENV_KEY)
    assert main(["encode", "hello", "--summary", "--address", server.address]) == 0
    assert main(["health", "--address", server.address]) == 0
    assert capsys.readouterr().out.strip().endswith("SERVING")


# ---- the same keys on the HTTP API ---------------------------------------------------------------------

HTTP_WRONG = {name: dict(md) if md and len(md) == 1 else None for name, md in WRONG.items() if name != "two headers"}


@pytest.mark.parametrize("wrong", HTTP_WRONG)
def test_http_wants_the_same_keys(server: ServerThread, wrong: str) -> None:
    before = server.counted_all("UNAUTHENTICATED")
    routes: list[tuple[str, str, dict[str, Any] | None]] = [
        ("POST", "/v1/embeddings", {"input": "hi"}),
        ("GET", "/v1/models", None),
        ("POST", "/v2/models/tiny/infer", {"inputs": []}),
        ("GET", "/v2/models/tiny", None),
        ("POST", "/embed", {"inputs": "hi"}),
        ("POST", "/", {"inputs": "hi"}),
        ("POST", "/tokenize", {"inputs": "hi"}),
        ("GET", "/info", None),
    ]
    for method, path, body in routes:
        reply = request(method, server.http_url + path, body, HTTP_WRONG[wrong] or {})
        assert reply.status == 401, (path, reply.body)
        assert "missing or invalid API key" in reply.body.decode() and not any(k in reply.body.decode() for k in KEYS)
        assert reply.headers["www-authenticate"] == 'Bearer realm="mhaserve"'  # RFC 9110: a 401 names its scheme
    # counted as the answer goes out, so the last count may land just after the client has it
    wait_until(lambda: server.counted_all("UNAUTHENTICATED") - before == len(routes), "every refusal counted")
    assert server.depth() == 0


def test_a_refused_request_with_a_body_closes_its_connection(server: ServerThread) -> None:
    """A 401 sent without reading the body kept the connection open: a client without a key could trickle
    the body a byte at a time for as long as it liked, one file descriptor each."""
    with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=WAIT) as s:
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(b'Content-Length: 1000\r\n\r\n{"input":')
        answer = b""
        while chunk := s.recv(4096):  # b"" once the server closes; a timeout (WAIT) if it holds on
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower(), answer[:200]


def test_a_path_cannot_forge_a_log_line(server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    """The refusal is logged before any key is checked, with the percent-decoded path: a newline in it
    forged a well-formed log line, and escape codes reached the operator's terminal."""
    middleware.REFUSALS.reset()
    with caplog.at_level(logging.INFO, logger="mhaserve.service.http.middleware"):
        forged = "/v1/x%0a2026-11-28%2006:00:00,000%20INFO%20mhaserve:%20key%20accepted%1b[31m"
        assert request("GET", server.http_url + forged).status == 401
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused GET")]
    assert "\n" not in line and "\x1b" not in line and "key accepted" in line, line


def test_the_openai_client_gets_authentication_errors_and_in_with_a_key(server: ServerThread) -> None:
    import openai

    url = server.http_url + "/v1"
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=url, api_key="not-a-key", max_retries=0).embeddings.create(input="hi", model="tiny")
    assert e.value.status_code == 401
    for key in KEYS:
        response = openai.OpenAI(base_url=url, api_key=key, max_retries=0).embeddings.create(input="hi", model="tiny")
        assert len(response.data) == 1


def test_http_health_probes_and_the_api_description_are_open(server: ServerThread) -> None:
    for path in ("/health", "/ping", "/", "/v2/health/live", "/v2/health/ready", "/openapi.json", "/docs"):
        assert request("GET", server.http_url + path).status == 200, path
        assert request("HEAD", server.http_url + path).status == 200, path
    # open to a probe's GET, not to the model: a POST of / embeds (TEI's), and needs a key
    before = server.counted_all("UNAUTHENTICATED")
    assert request("POST", server.http_url + "/", {"inputs": "hi"}).status == 401
    assert request("POST", server.http_url + "/health", {}).status == 401
    assert request("GET", server.http_url + "/v2/models/tiny/ready").status == 401  # as ModelReady on gRPC
    # a probe refused for want of a key is counted, as gRPC counts ModelReady's refusal (it was not); each
    # refusal is counted as its answer goes out, after the client may have read it, so all three are waited for
    wait_until(lambda: server.counted_all("UNAUTHENTICATED") - before == 3, "the refusals counted")


# ---- clients without a key and --max-incoming-bytes ------------------------------------------------------

BUDGET = 64 << 10  # the --max-message-bytes of the server below, whose --max-incoming-bytes is one such message


@pytest.fixture(scope="module")
def budgeted(tiny_repo: Path, keys_file: Path) -> Iterator[ServerThread]:
    """A server with keys whose budget of request bytes still arriving holds one message at the limit: whatever a
    client without a key held of it, a keyed request of that size would be refused. On the lean gRPC front, the
    one that counts gRPC messages against it (grpc.aio's reads them in grpc core)."""
    settings = _keyed(tiny_repo, keys_file, "lean", max_message_bytes=BUDGET, max_incoming_bytes=BUDGET + 5)
    with ServerThread(settings) as srv:
        yield srv.ready()


def _keyed_requests_get_the_whole_budget(server: ServerThread) -> None:
    """A keyed request of nearly BUDGET bytes on each port is served."""
    text = "x" * (BUDGET - 200)
    reply = request("POST", server.http_url + "/v1/embeddings", {"input": text}, dict(bearer(FILE_KEY)))
    assert reply.status == 200, reply.body[:200]
    with server.channel() as channel:
        answer = pb_grpc.EncoderServiceStub(channel).Encode(
            pb.EncodeRequest(texts=[text]), metadata=bearer(FILE_KEY), timeout=WAIT
        )
    assert len(answer.embeddings) == 1


def test_http_clients_without_a_key_cannot_hold_request_bytes_on_the_open_routes(budgeted: ServerThread) -> None:
    """The open routes (probes, the API's description) take no body: one announced is not read into the request
    nor counted against --max-incoming-bytes, and the answer closes the connection. They read it and counted it:
    89 GET /health without a key, each sending 3 MB of 4, held 267 of the 268 MB, and keyed requests on both
    ports were refused 429 / RESOURCE_EXHAUSTED until the bodies timed out, when the clients sent 89 more."""
    port = budgeted.server.http_port
    with contextlib.ExitStack() as stack:
        clients = []
        for path in ("/health", "/v2/health/ready", "/openapi.json"):
            client = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=WAIT))
            head = f"GET {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {BUDGET}\r\n\r\n".encode()
            client.sendall(head + bytes(BUDGET // 2))
            clients.append(client)
        for client in clients:
            answer = b""
            while chunk := client.recv(65536):  # b"" once the server closes; a timeout (WAIT) if it reads on
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower(), answer[:200]
        assert budgeted.gauge("mhaserve_incoming_request_bytes") == 0
        _keyed_requests_get_the_whole_budget(budgeted)


def _call_sending(stream_id: int, path: str, size: int, sent: int) -> bytes:
    """A gRPC call without a key whose message of `size` bytes is sent only as far as `sent` bytes (its prefix
    included)."""
    message = b"\x00" + size.to_bytes(4, "big") + bytes(size)
    head = f.frame(f.HEADERS, f.END_HEADERS, stream_id, call_block(path))
    return head + b"".join(
        f.frame(f.DATA, 0, stream_id, message[i : min(i + 16384, sent)]) for i in range(0, sent, 16384)
    )


def test_grpc_calls_without_a_key_cannot_hold_request_bytes(budgeted: ServerThread) -> None:
    """On the lean front, a call without a key to a closed method is refused UNAUTHENTICATED as its headers come,
    its message unread; a probe's message (health, reflection) over a few KiB is refused RESOURCE_EXHAUSTED as
    its size comes; and a probe's message still arriving is not counted against --max-incoming-bytes. A closed
    method's refusal waited for the whole message, and a probe took messages up to --max-message-bytes, both
    counted: 89 such calls on one connection held the budget of both ports until --http-header-timeout."""
    with socket.create_connection(("127.0.0.1", budgeted.server.port), timeout=WAIT) as raw:
        raw.sendall(f.PREFACE + f.settings())
        raw.sendall(_call_sending(1, "/encoder.v1.EncoderService/Encode", BUDGET, BUDGET // 2))
        raw.sendall(_call_sending(3, "/grpc.health.v1.Health/Check", BUDGET, BUDGET // 2))
        raw.sendall(_call_sending(5, "/grpc.health.v1.Health/Check", 100, 50))
        raw.sendall(f.frame(f.PING, 0, 0, b"all read"))  # answered once the frames before it are read

        def done(frames: list[Frame]) -> bool:
            pinged = any(kind == f.PING and payload == b"all read" for kind, _, _, payload in frames)
            return pinged and {1, 3} <= answers(frames).keys()

        got = answers(read_until(raw, done))
        assert got[1]["grpc-status"] == str(grpc.StatusCode.UNAUTHENTICATED.value[0]), got
        assert got[3]["grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]), got
        assert 5 not in got  # its message still arriving: held, and only that little
        assert budgeted.gauge("mhaserve_incoming_request_bytes") == 0
        _keyed_requests_get_the_whole_budget(budgeted)


# ---- admin keys: the repository API ---------------------------------------------------------------------

ADMIN_KEY = "admin-key-5e9b21d7"


@pytest.fixture(scope="module")
def admin_server(secured: Settings) -> Iterator[ServerThread]:
    settings = dataclasses.replace(
        secured, model_control="explicit", admin_keys=ApiKeys((ADMIN_KEY,)), http_port=free_port()
    )
    with ServerThread(settings) as srv:
        yield srv.ready()


def test_a_client_key_on_the_repository_api_is_logged_each_time_beside_a_flood_without_keys(
    admin_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """The lines of calls without a valid key are throttled; a valid client key on the admin API is what an
    operator most wants to see, and shared their budget: "denied", every one."""
    for throttle in (rpc_auth.REFUSALS, middleware.REFUSALS):
        throttle.reset()
    url = admin_server.http_url + "/v2/repository/index"
    with caplog.at_level(logging.INFO, logger="mhaserve.service"), admin_server.channel() as channel:
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        for metadata in [None] * 15 + [bearer(FILE_KEY)] * 3:
            with pytest.raises(grpc.RpcError):
                kserve.RepositoryIndex(kpb.RepositoryIndexRequest(), metadata=metadata, timeout=WAIT)
        keyless: dict[str, str] = {}
        for headers in [keyless] * 15 + [{"authorization": f"Bearer {FILE_KEY}"}] * 3:
            assert request("POST", url, {}, headers).status in (401, 403)
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if line.startswith("denied /inference.GRPCInferenceService/")]) == 3, lines
    assert len([line for line in lines if line.startswith("denied POST /v2/repository/index")]) == 3, lines
    assert len([line for line in lines if line.startswith("refused ")]) < 30, lines


def test_the_repository_api_wants_an_admin_key(admin_server: ServerThread) -> None:
    with admin_server.channel() as channel:
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        calls = {
            "index": lambda md: kserve.RepositoryIndex(kpb.RepositoryIndexRequest(), metadata=md, timeout=WAIT),
            "load": lambda md: kserve.RepositoryModelLoad(
                kpb.RepositoryModelLoadRequest(model_name="tiny"), metadata=md, timeout=WAIT
            ),
        }
        for name, call in calls.items():
            for metadata, code in (
                (None, grpc.StatusCode.UNAUTHENTICATED),
                (bearer("not-a-key"), grpc.StatusCode.UNAUTHENTICATED),
                (bearer(FILE_KEY), grpc.StatusCode.PERMISSION_DENIED),  # a client key: right, but not enough
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call(metadata)
                assert e.value.code() == code, name
            call(bearer(ADMIN_KEY))
        # an admin key is a key: it may also embed
        enc = pb_grpc.EncoderServiceStub(channel)
        assert enc.Encode(pb.EncodeRequest(texts=["hi"]), metadata=bearer(ADMIN_KEY), timeout=WAIT).embeddings
    url = admin_server.http_url + "/v2/repository/index"
    assert request("POST", url, {}).status == 401
    assert request("POST", url, {}, {"authorization": f"Bearer {FILE_KEY}"}).status == 403
    reply = request("POST", url, {}, {"authorization": f"Bearer {ADMIN_KEY}"})
    assert reply.status == 200 and reply.json()[0]["name"] == "tiny"


def test_without_admin_keys_the_repository_api_is_closed_when_keys_are_on(server: ServerThread) -> None:
    with server.channel() as channel:
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            kserve.RepositoryIndex(kpb.RepositoryIndexRequest(), metadata=bearer(FILE_KEY), timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "needs an admin key" in str(e.value.details())
