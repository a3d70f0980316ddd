"""The OpenAPI document at /openapi.json says what the server answers (service/http/openapi.py).

Checked two ways: the document itself (every reference resolves, every error documented in its API's
shape, no FastAPI 422 that the server never sends), and schemathesis, the tool users check an API
against its document with, run on a real server: requests generated from the document, valid and not,
every answer's status, content type, headers and body checked against it, and never a 5xx.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mhaserve.service.http.openapi import FASTAPI_VALIDATION, REF, SECURITY, refs
from mhaserve.service.settings import ApiKeys
from mhaserve.service.tei_timing import DESCRIPTIONS
from mhaserve.testing.http import request
from mhaserve.testing.server import ServerThread, local_settings

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
KEY = "a-test-key"
# The model routes take the served model's name and version: schemathesis then reaches past the lookup into
# the routes' own checks (an unknown model is a 404 either way, tested in test_http.py and test_kserve.py).
CONFIG = """\
[parameters]
model_name = "tiny"
model_version = "1"
"""


@pytest.fixture(scope="module")
def srv(tiny_repo: Path) -> Iterator[ServerThread]:
    with ServerThread(local_settings(tiny_repo)).ready() as server:
        yield server


@pytest.fixture(scope="module")
def document(srv: ServerThread) -> dict[str, Any]:
    reply = request("GET", srv.http_url + "/openapi.json")
    assert reply.status == 200
    return reply.json()


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield path, method, operation


def test_every_reference_resolves(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    found = set(refs(document))
    assert REF.format(model="RepositoryIndexRequest") in found  # a route's body, named by its route only
    missing = sorted(ref for ref in found if ref.removeprefix(REF.format(model="")) not in schemas)
    assert missing == [], f"references to schemas the document does not have: {missing}"


TEI = ("/embed", "/", "/invocations", "/similarity")


def test_errors_are_documented_in_each_apis_shape_and_no_422(document: dict[str, Any]) -> None:
    for path, method, operation in operations(document):
        responses = operation["responses"]
        assert "422" not in responses, (method, path)
        schema = responses["default"]["content"]["application/json"]["schema"]
        shape = "KServeError" if path.startswith("/v2") else "TEIError" if path in TEI else "OpenAIError"
        assert schema == {"$ref": REF.format(model=shape)}, (method, path)
    schemas = document["components"]["schemas"]
    assert not set(FASTAPI_VALIDATION) & set(schemas)
    assert schemas["KServeError"]["properties"]["error"]["type"] == "string"
    assert set(schemas["OpenAIErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert set(schemas["TEIError"]["properties"]) == {"error", "error_type"}


def test_teis_routes_document_their_timing_headers(document: dict[str, Any]) -> None:
    """What TEI's routes answer beside the vectors (schemathesis, below, checks the answers against it)."""
    for path in ("/embed", "/similarity", "/", "/invocations"):
        headers = document["paths"][path]["post"]["responses"]["200"]["headers"]
        assert set(headers) == set(DESCRIPTIONS) and "x-inference-time" in headers, path
        assert all(h["schema"] == {"type": "string", "pattern": "^[0-9]+$"} for h in headers.values()), path


def test_invocations_documents_json_lines_both_ways(document: dict[str, Any], srv: ServerThread) -> None:
    """/invocations reads a JSON Lines body and answers one in kind (SageMaker's batch transform): the document
    says so, as it says every other body and answer, so that a client generated from it can send one."""
    operation = document["paths"]["/invocations"]["post"]
    sent = operation["requestBody"]["content"]
    answered = operation["responses"]["200"]["content"]
    assert set(sent) == set(answered) == {"application/json", "application/jsonlines"}
    assert sent["application/jsonlines"]["schema"]["type"] == "string"
    assert answered["application/jsonlines"]["schema"]["type"] == "string"
    reply = request(
        "POST",
        srv.http_url + "/invocations",
        b'{"inputs": "a"}\n{"inputs": "b"}\n',
        {"content-type": "application/jsonlines"},
    )
    assert reply.status == 200 and reply.headers["content-type"] in answered
    assert len(reply.body.splitlines()) == 2


def test_health_answers_are_documented_with_the_protocols_bodies(document: dict[str, Any]) -> None:
    paths = document["paths"]
    fields = {
        "/v2/health/live": {"live"},
        "/v2/health/ready": {"ready"},
        "/v2/models/{model_name}/ready": {"name", "ready"},
    }
    for path, names in fields.items():
        ok = paths[path]["get"]["responses"]["200"]
        assert set(ok["content"]["application/json"]["schema"]["properties"]) == names, path
    assert "400" in paths["/v2/health/ready"]["get"]["responses"]
    # the repository's load and unload answer with a status alone, as Triton's do
    assert "content" not in paths["/v2/repository/models/{model_name}/load"]["post"]["responses"]["200"]
    health = paths["/health"]["get"]["responses"]
    assert {"200", "503"} <= set(health)
    # the repository API's bodies are optional: tritonclient sends none
    assert paths["/v2/repository/index"]["post"]["requestBody"]["required"] is False


def test_without_api_keys_no_operation_asks_for_one(document: dict[str, Any]) -> None:
    assert "securitySchemes" not in document["components"]
    assert not any("security" in operation for _, _, operation in operations(document))


def test_with_api_keys_every_operation_but_the_open_ones_asks_for_one(tiny_repo: Path) -> None:
    with ServerThread(local_settings(tiny_repo, api_keys=ApiKeys((KEY,)))).ready() as keyed:
        document = request("GET", keyed.http_url + "/openapi.json").json()  # open: no key
    assert document["components"]["securitySchemes"][SECURITY] == {
        "type": "http",
        "scheme": "bearer",
        "description": document["components"]["securitySchemes"][SECURITY]["description"],
    }
    asks = {(method, path) for path, method, operation in operations(document) if operation.get("security")}
    everything = {(method, path) for path, method, _ in operations(document)}
    assert everything - asks == {
        ("get", "/health"),
        ("get", "/ping"),
        ("get", "/"),
        ("get", "/v2/health/live"),
        ("get", "/v2/health/ready"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["defaults", "api-keys", "explicit"])
def test_the_server_answers_as_its_document_says(
    srv: ServerThread, tiny_repo: Path, tmp_path: Path, variant: str
) -> None:
    """With API keys, schemathesis sends the key, and (its `ignored_auth` check) each operation the document
    says needs one again without it and with a wrong one, expecting a 401. Under `--model-control explicit`
    the repository API loads and unloads the model as the calls come."""
    key = {"authorization": f"Bearer {KEY}"} if variant == "api-keys" else {}
    with contextlib.ExitStack() as stack:
        if variant != "defaults":
            own = {"api_keys": ApiKeys((KEY,))} if key else {"model_control": "explicit"}
            srv = stack.enter_context(ServerThread(local_settings(tiny_repo, **own)).ready())
        run_schemathesis(srv, tmp_path, [f"--header=Authorization: {key['authorization']}"] if key else [])
        if variant == "explicit":  # whatever the last call left, the model can be loaded and served again
            assert request("POST", srv.http_url + "/v2/repository/models/tiny/load").status == 200
        reply = request("POST", srv.http_url + "/v1/embeddings", {"input": "still serving", "model": "tiny"}, key)
        assert reply.status == 200


def run_schemathesis(srv: ServerThread, tmp_path: Path, options: list[str]) -> None:
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    run = subprocess.run(
        [
            str(SCHEMATHESIS),
            "run",
            srv.http_url + "/openapi.json",
            *options,
            "--checks",
            "all",
            # A request the document allows may still be refused with a 400 for what no schema states: a model
            # named name:version asked for at another version, a prompt the model does not have, a token id past
            # its vocabulary, the repository API without --model-control explicit. Every other check runs.
            "--exclude-checks",
            "positive_data_acceptance",
            "--max-examples",
            "60",
            "--seed",
            "1",
            "--workers",
            "1",
            "--generation-database",
            "none",
            "--no-color",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "passed" in run.stdout and "Fuzzing" in run.stdout
