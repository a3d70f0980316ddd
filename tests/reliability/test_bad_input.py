"""Bad input, property-based: hypothesis over every request field of encoder.v1 and the Open Inference
Protocol against one running server. Never INTERNAL or UNKNOWN, never a lost stream response, the
server keeps SERVING, and a good request after every case gets the same answer as before."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from mhaserve.loadtest.reliability.scenarios.bad_input import CLIENT_CODES, fuzz
from mhaserve.loadtest.reliability.strategies import Model
from mhaserve.service.settings import Settings
from mhaserve.testing.server import ServerThread
from tests.conftest import TINY

EXAMPLES = 150  # per API; `make reliability` runs thousands
MODEL = Model(name="tiny", vocab_size=TINY["vocab_size"], max_tokens=TINY["max_seq_len"], max_inputs=8)


@pytest.fixture(scope="module")
def server(tiny_repo: Path) -> Iterator[ServerThread]:
    settings = Settings(repository=tiny_repo, port=0, metrics_port=0, http_port=0, device="cpu", intra_op_threads=1)
    with ServerThread(dataclasses.replace(settings, max_client_batch_size=MODEL.max_inputs)) as srv:
        yield srv.ready()


@pytest.mark.slow
def test_no_request_field_can_make_the_server_fail(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    result = fuzz(server.address, MODEL, examples=EXAMPLES, seed=20261122)
    with capsys.disabled():
        print(f"\nbad input: {dict(result.cases)} cases in {result.seconds:.1f} s; codes {result.codes}")
    assert result.failures == []
    for api in ("encoder.v1", "inference.v2"):
        assert result.cases[api] >= EXAMPLES * 0.9, "hypothesis ran fewer cases than asked"
        assert set(result.codes[api]) <= CLIENT_CODES
        # the strategies do reach past the first checks: answers, refusals and unknown models all occur
        assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND"} <= set(result.codes[api])
    assert result.checks_after == sum(result.cases.values())
    assert server.counted_all("INTERNAL") == server.counted_all("UNKNOWN") == 0
    assert server.depth() == 0
