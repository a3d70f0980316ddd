"""The real default model, exported once per session: parity on the full grid and fidelity to the reference."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from mhaserve.model.checkpoint import default_source, load_encoder
from mhaserve.runtime.manifest import read_manifest
from mhaserve.runtime.tokenizer import load_for_serving
from tests.conftest import VARIED_TEXTS

pytestmark = pytest.mark.slow


def _normalize(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_manifest(minilm_entry: Path) -> None:
    m = read_manifest(minilm_entry)
    assert (m.name, m.version) == ("all-minilm-l6-v2", 1)
    assert (m.hidden_size, m.layers, m.heads, m.max_seq_len, m.vocab_size) == (384, 6, 12, 256, 30522)
    assert m.pooling == "mean" and m.normalize
    assert set(m.graphs) == {"fp32", "optimized", "optimized-cpu", "int8"}
    fused = m.graphs["optimized"].parity
    assert fused["fusions"]["skip_layer_normalization"] == 12
    assert fused["fusions"]["packed_qkv_attention"] == 6 and fused["fusions"]["embed_layer_norm"] == 1
    cpu = m.graphs["optimized-cpu"].parity
    assert cpu["plain_layer_norms"] == 12 and "SkipLayerNormalization" not in cpu["node_types"]
    # the export measured every CPU graph against the plain fp32 graph
    assert set(cpu["speed_at_export"]) >= {"short", "mixed"} and cpu["speed_at_export"]["relative_to"] == "fp32"


def test_fused_graph_node_types(minilm_entry: Path) -> None:
    """52 nodes: ONNX Runtime's BERT optimizer's fusions on a legacy export of the same model make 68."""
    from tests.export.test_fusions import MEAN_POOLING, fused_node_types

    types = read_manifest(minilm_entry).graphs["optimized"].parity["node_types"]
    g = onnx.load(str(minilm_entry / "model.optimized.onnx"), load_external_data=False)
    assert types == dict(Counter(n.op_type for n in g.graph.node)) == fused_node_types(6, MEAN_POOLING)
    assert sum(types.values()) == 52


def test_parity_on_the_grid(minilm_entry: Path) -> None:
    """batch {1,2,3,32} x seq {1,2,7,128,256}, rows partly padding, eager vs ONNX Runtime: <= 1e-5."""
    model, _ = load_encoder(default_source())
    sessions = [
        ort.InferenceSession(str(minilm_entry / f), providers=["CPUExecutionProvider"])
        for f in ("model.onnx", "model.optimized.onnx", "model.optimized-cpu.onnx")
    ]
    rng = np.random.default_rng(42)
    worst = 0.0
    for batch in (1, 2, 3, 32):
        for seq in (1, 2, 7, 128, 256):
            lengths = np.maximum(1, (seq * rng.uniform(0.2, 1.0, size=batch)).astype(int))
            lengths[0] = seq
            mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
            ids = rng.integers(1000, 30522, size=(batch, seq)).astype(np.int64) * mask
            with torch.no_grad():
                want = model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
            for sess in sessions:
                got = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
                worst = max(worst, float(np.abs(got - want).max()))
    assert worst <= 1e-5, worst


def test_exported_tokenizer_matches_sentence_transformers(minilm_entry: Path, sentence_transformer) -> None:
    tok = load_for_serving(minilm_entry / "tokenizer.json", 256)
    ref = sentence_transformer.tokenize(VARIED_TEXTS)
    for i, enc in enumerate(tok.encode_batch(VARIED_TEXTS)):
        n = int(ref["attention_mask"][i].sum())
        assert enc.ids == ref["input_ids"][i][:n].tolist(), VARIED_TEXTS[i][:40]
    assert len(tok.encode(VARIED_TEXTS[-1]).ids) == 256


@pytest.mark.parametrize("graph", ["model.onnx", "model.optimized.onnx", "model.optimized-cpu.onnx"])
def test_exported_graph_matches_sentence_transformers(minilm_entry: Path, sentence_transformer, graph: str) -> None:
    """Exported tokenizer + graph + L2 normalisation vs sentence-transformers' encode."""
    tok = load_for_serving(minilm_entry / "tokenizer.json", 256)
    sess = ort.InferenceSession(str(minilm_entry / graph), providers=["CPUExecutionProvider"])
    want = sentence_transformer.encode(VARIED_TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    encs = tok.encode_batch(VARIED_TEXTS)
    T = max(len(e.ids) for e in encs)
    ids = np.array([e.ids + [0] * (T - len(e.ids)) for e in encs], dtype=np.int64)
    mask = np.array([e.attention_mask + [0] * (T - len(e.ids)) for e in encs], dtype=np.int64)
    got = _normalize(sess.run(None, {"input_ids": ids, "attention_mask": mask})[0])
    cos = (got * want).sum(axis=1)
    assert cos.min() >= 0.99999, dict(zip(VARIED_TEXTS, cos, strict=True))
    assert np.abs(got - want).max() <= 1e-5


def test_int8_graph_passed_its_gate(minilm_entry: Path) -> None:
    figures = read_manifest(minilm_entry).graphs["int8"].parity
    assert figures["passed"] and not figures["quantization"]["fp32"]  # every product int8
    assert figures["min_cosine"] >= 0.98 and figures["mean_cosine"] >= 0.995
    assert figures["retrieval"]["top1_agreement"] >= 0.95 and figures["retrieval"]["top10_overlap"] >= 0.9
    # the set is not trivial: fp32 itself ranks a near miss first for some queries
    assert 0.9 <= figures["retrieval"]["fp32_recall_at_1"] < 1.0


def test_int8_gate_fails_minilm_with_one_scale_25_percent_off(minilm_entry: Path, tmp_path: Path) -> None:
    """A subtle quantiser bug (one layer's QKV weight scales 1.25x): retrieval barely notices, the cosines do."""
    from mhaserve.export import int8_gate
    from mhaserve.runtime.engine import OnnxEngine
    from tests.export.test_int8 import damage

    bad = tmp_path / "model.int8.onnx"
    bad.write_bytes((minilm_entry / "model.int8.onnx").read_bytes())
    damage(bad, "Attention_0.qkv_weight_scale", 1.25)

    def engine(path: Path) -> OnnxEngine:
        return OnnxEngine(path, max_seq_len=256, vocab_size=30522, device="cpu")

    tok = load_for_serving(minilm_entry / "tokenizer.json", 256)
    report = int8_gate.check(
        engine(minilm_entry / "model.optimized.onnx"), engine(bad), tok, max_seq_len=256, vocab_size=30522, pad_id=0
    )
    assert not report.passed
    assert report.min_cosine < 0.98 and report.mean_cosine < 0.995


def test_int8_graph_stays_close_to_sentence_transformers(minilm_entry: Path, sentence_transformer) -> None:
    tok = load_for_serving(minilm_entry / "tokenizer.json", 256)
    sess = ort.InferenceSession(str(minilm_entry / "model.int8.onnx"), providers=["CPUExecutionProvider"])
    want = sentence_transformer.encode(VARIED_TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    got = np.concatenate(
        [
            sess.run(None, {"input_ids": np.array([e.ids]), "attention_mask": np.array([e.attention_mask])})[0]
            for e in tok.encode_batch(VARIED_TEXTS)
        ]
    )
    cos = (_normalize(got) * want).sum(axis=1)
    assert cos.min() >= 0.98, dict(zip(VARIED_TEXTS, cos, strict=True))
