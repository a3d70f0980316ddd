"""Two per-request costs on the event loop, in a tight loop (thirtieth session): the encoder.v1 answer built
from a row of 384 floats (as service/encoder_v1.py's to_pb does) against the same message parsed from its
packed bytes, and the L2 norm of one row (service/pipeline.py's l2_normalize) against a batch's.

    .venv/bin/python docs/bench/2026-11-30-thirtieth/answer_costs.py
"""

from __future__ import annotations

import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.service.encoder_v1 import to_pb
from mhaserve.service.pipeline import EncodeOutput, l2_normalize

N = 20000


def us(f: Callable[[], Any]) -> float:
    """Microseconds a call, the best of 5 repeats of N."""
    return min(timeit.repeat(f, number=N, repeat=5)) / N * 1e6


def varint(v: int) -> bytes:
    out = bytearray()
    while True:
        low, v = v & 0x7F, v >> 7
        if not v:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def from_bytes(output: EncodeOutput) -> pb.EncodeResponse:
    """to_pb's answer, each Embedding parsed from its packed floats (field 1, wire type 2)."""
    rows = np.ascontiguousarray(output.embeddings, dtype="<f4")
    head = b"\x0a" + varint(rows.shape[1] * 4)
    r = pb.EncodeResponse(
        model=output.model, model_version=output.version, usage=pb.Usage(input_tokens=output.input_tokens)
    )
    for row in rows:
        r.embeddings.add().MergeFromString(head + row.tobytes())
    return r


def main() -> None:
    batch = np.random.default_rng(0).random((16, 384), dtype=np.float32)
    row = batch[3:4]
    out = EncodeOutput(embeddings=row, model="m", version=1, input_tokens=20)
    assert from_bytes(out) == to_pb(out)
    print(f"l2_normalize, one row    {us(lambda: l2_normalize(row)):6.2f} us")
    print(f"l2_normalize, 16 rows    {us(lambda: l2_normalize(batch)):6.2f} us")
    print(f"to_pb, plain             {us(lambda: to_pb(out)):6.2f} us")
    print(f"to_pb, packed            {us(lambda: to_pb(out, True)):6.2f} us")
    print(f"the plain answer, parsed {us(lambda: from_bytes(out)):6.2f} us")


if __name__ == "__main__":
    main()
