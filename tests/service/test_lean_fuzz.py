"""The lean front's fuzzing harness (tests/service/lean_fuzz.py) in the suite: inputs from a seeded random
source, and the corpus a coverage-guided run left (lean_fuzz_corpus.bin), each held to the harness's checks
(nothing unhandled, whole frames within the client's windows and frame size, HPACK in order, no frame of a
stream after its end, every handler ended)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from typing import cast

import hpack
import pytest

from mhaserve.service.rpc.lean import frames as f
from tests.service.lean_fuzz import Harness, frames_of, unpack


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness(memory=True)
    yield h
    h.close()


def outcomes(written: bytes) -> Iterator[str]:
    decoder = hpack.Decoder()
    for kind, _flags, _stream, payload in frames_of(written):
        if kind == f.HEADERS:
            fields = cast(list[tuple[str, str]], decoder.decode(payload))  # str: the decoder's default
            yield from (f"status {v}" for k, v in fields if k == "grpc-status")
            message = dict(fields).get("grpc-message", "")
            if "--max-incoming-bytes" in message:
                yield "incoming limit"
            elif "to arrive" in message:
                yield "message too slow"
        elif kind == f.GOAWAY:
            yield f"goaway {int.from_bytes(payload[4:8], 'big')}"
        elif kind == f.RST_STREAM:
            yield "reset"


def test_random_clients_are_answered_within_the_protocol(harness: Harness) -> None:
    """400 clients made from seeded random bytes; what they met covers the front's paths: calls answered
    OK and with errors, streams reset, connections ended for a protocol error and for a header block that
    does not decode (otherwise the harness would check little)."""
    rng = random.Random(18)
    seen: Counter[str] = Counter()
    for _ in range(400):
        seen.update(outcomes(harness.run(rng.randbytes(rng.randrange(0, 1500)))))
    for outcome in ("status 0", "status 3", "status 8", "status 12", "reset", "goaway 1", "goaway 9"):
        assert seen[outcome] > 0, (outcome, seen)


def test_the_fuzzers_corpus_is_answered_within_the_protocol(harness: Harness) -> None:
    """Every input of the corpus a coverage-guided run left (each one reached code the others did not):
    1,451 inputs kept of 449,000 tried in four runs (2026-12-01)."""
    inputs = unpack()
    assert len(inputs) > 500
    seen: Counter[str] = Counter()
    for data in inputs:
        seen.update(outcomes(harness.run(data)))
    # What it reaches (a change to the harness that made its inputs mean less would show here): calls OK and
    # refused for each reason, streams reset, and connections ended for each kind of error.
    for outcome in ("status 0", "status 3", "status 8", "status 9", "status 12", "status 2", "reset"):
        assert seen[outcome] > 0, (outcome, seen)
    # Calls refused at the small limit on request bytes still arriving, and failed as too slow (the harness
    # fails every call whose message is still arriving before the client goes): service/incoming.py
    assert seen["incoming limit"] > 0 and seen["message too slow"] > 0, seen
    for code in (f.PROTOCOL_ERROR, f.FLOW_CONTROL_ERROR, f.FRAME_SIZE_ERROR, f.COMPRESSION_ERROR, f.ENHANCE_YOUR_CALM):
        assert seen[f"goaway {code}"] > 0, (code, seen)
