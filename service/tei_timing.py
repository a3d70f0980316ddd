"""What text-embeddings-inference tells a client of where its request's time went, as TEI's two fronts here
answer it: the headers of an embedding answer on TEI's HTTP routes (tei.py), and a tei.v1 `Embed` call's
initial metadata beside its `Metadata` message (tei_v1.py)."""

from __future__ import annotations

from mhaserve.service.pipeline import EncodeInput, EncodeOutput

Fields = tuple[tuple[str, str], ...]
# Each header, as the HTTP routes' OpenAPI document describes it.
DESCRIPTIONS = {
    "x-compute-time": "the request's time in the server, in whole milliseconds (as x-total-time)",
    "x-compute-characters": "the inputs' characters (a token-id list's ids)",
    "x-compute-tokens": "the inputs' tokens, prompt and special tokens included",
    "x-total-time": "the request's time in the server, in whole milliseconds",
    "x-tokenization-time": "milliseconds of it before the queue: the checks and tokenisation",
    "x-queue-time": "milliseconds of it queued, until the model began its first input",
    "x-inference-time": "milliseconds of it in the model, from its first input to its last",
}


def characters(asked: EncodeInput) -> int:
    """The inputs' characters, a token-id list's ids, as TEI counts them (its prompt is not counted)."""
    return sum(map(len, asked.texts)) if asked.texts else sum(map(len, asked.token_ids))


def timing(chars: int, output: EncodeOutput, total_ns: int) -> Fields:
    """TEI's headers: the inputs' characters and tokens (prompt and special tokens included), and in whole
    milliseconds the request's time in the server (`x-total-time`, and `x-compute-time` the same, as TEI's)
    and where it went: tokenisation (with the checks before it), the queue, the model. For a request of
    several inputs, the time until its first input reached the model and from then until its last was
    computed, where TEI averages each input's (the same for one input). TEI's `x-compute-type`, a constant
    there, is not sent."""
    total = str(total_ns // 1_000_000)
    return (
        ("x-compute-time", total),
        ("x-compute-characters", str(chars)),
        ("x-compute-tokens", str(output.input_tokens)),
        ("x-total-time", total),
        ("x-tokenization-time", str(output.tokenization_ns // 1_000_000)),
        ("x-queue-time", str(output.queue_ns // 1_000_000)),
        ("x-inference-time", str(output.inference_ns // 1_000_000)),
    )
