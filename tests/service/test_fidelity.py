"""What the server returns for MiniLM equals sentence-transformers' own encode of the same texts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.service.settings import Settings
from mhaserve.testing.loopback import WAIT
from mhaserve.testing.server import ServerThread
from tests.conftest import VARIED_TEXTS


@pytest.mark.slow
def test_served_minilm_equals_sentence_transformers(minilm_entry: Path, sentence_transformer) -> None:
    expected = sentence_transformer.encode(VARIED_TEXTS, convert_to_numpy=True, normalize_embeddings=False)
    settings = Settings(repository=minilm_entry.parent.parent, port=0, metrics_port=0, http_port=0, device="cpu")
    srv = ServerThread(settings).ready()
    try:
        with srv.channel() as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            together = stub.Encode(pb.EncodeRequest(texts=VARIED_TEXTS, truncate=True), timeout=WAIT)
            calls = [stub.Encode.future(pb.EncodeRequest(texts=[t], truncate=True), timeout=WAIT) for t in VARIED_TEXTS]
            alone = [c.result(timeout=WAIT) for c in calls]
    finally:
        srv.stop()
    assert together.model == "all-minilm-l6-v2"
    for response in (together, *alone):
        assert all(len(e.values) == 384 for e in response.embeddings)
    served = np.array([e.values for e in together.embeddings])
    served_alone = np.array([r.embeddings[0].values for r in alone])
    for got in (served, served_alone):
        cosine = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
        assert cosine.min() >= 0.99999, cosine
    # The manifest says normalise, as the sentence-transformers pipeline does.
    np.testing.assert_allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)
