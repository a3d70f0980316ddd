"""The fused graph (`--optimize`): ONNX Runtime's fused operators, and each fusion checked against the model."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from mhaserve.export import layer_norms, parity
from mhaserve.export.publish import ExportOptions, export_entry
from mhaserve.model.config import EncoderConfig
from mhaserve.model.encoder import random_encoder
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.manifest import read_manifest
from tests.conftest import TINY

# The pooling (mean over the mask) and the int64 -> int32 casts of the two inputs are all that is not fused.
MEAN_POOLING = {"Unsqueeze": 1, "Cast": 1, "Mul": 1, "ReduceSum": 2, "Clip": 1, "Div": 1}


def fused_node_types(n_layers: int, pooling: dict[str, int]) -> dict[str, int]:
    """What ONNX Runtime's BERT optimizer makes of a legacy export: one EmbedLayerNormalization, and per layer
    one Attention (Q, K and V packed into one weight), the attention output MatMul, two SkipLayerNormalization,
    the FFN's two MatMuls with a BiasGelu between them."""
    types = Counter(
        {
            "Cast": 2,  # input_ids and attention_mask to int32, for the contrib operators
            "EmbedLayerNormalization": 1,
            "Attention": n_layers,
            "MatMul": 3 * n_layers,
            "SkipLayerNormalization": 2 * n_layers,
            "BiasGelu": n_layers,
        }
    )
    types.update(pooling)
    return dict(types)


def _graph(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path))


def test_fused_graph_has_exactly_the_fused_operators(tiny_entry: Path) -> None:
    g = _graph(tiny_entry / "model.optimized.onnx")
    types = dict(Counter(n.op_type for n in g.graph.node))
    assert types == fused_node_types(TINY["n_layers"], MEAN_POOLING)
    m = read_manifest(tiny_entry)
    figures = m.graphs["optimized"].parity
    assert figures["nodes"] == len(g.graph.node) and figures["node_types"] == dict(sorted(types.items()))
    assert figures["fusions"]["packed_qkv_attention"] == TINY["n_layers"]
    assert figures["fusions"]["embed_layer_norm"] == 1
    assert m.graphs["fp32"].parity["nodes"] > 3 * len(g.graph.node)


def test_cpu_graph_is_the_fused_graph_with_plain_layer_norms(tiny_entry: Path) -> None:
    """`optimized-cpu`: every fusion of the fused graph but SkipLayerNormalization, each of which is eleven or
    twelve plain operators (twelve where it adds a bias), with the reciprocal of the standard deviation."""
    g = _graph(tiny_entry / "model.optimized-cpu.onnx")
    types = Counter(n.op_type for n in g.graph.node)
    fused = Counter(fused_node_types(TINY["n_layers"], MEAN_POOLING))
    norms = fused.pop("SkipLayerNormalization")
    fused_graph = _graph(tiny_entry / "model.optimized.onnx").graph
    biased = sum(1 for n in fused_graph.node if n.op_type == "SkipLayerNormalization" and len(n.input) > 4)
    assert "SkipLayerNormalization" not in types
    plain = types - fused
    assert plain == Counter(
        {"Add": 3 * norms + biased, "ReduceMean": 2 * norms, "Sub": norms, "Mul": 3 * norms}
    ) + Counter({"Sqrt": norms, "Reciprocal": norms})
    assert fused - types == Counter()  # and the rest, the other fusions, all there
    m = read_manifest(tiny_entry)
    figures = m.graphs["optimized-cpu"].parity
    assert figures["plain_layer_norms"] == norms and figures["node_types"] == dict(sorted(types.items()))
    assert "skip_layer_normalization" not in figures["fusions"]
    assert figures["fusions"]["packed_qkv_attention"] == TINY["n_layers"]
    assert figures["passed"] and figures["max_abs_diff"] <= figures["tolerance"] == 1e-5


def test_cpu_graph_refuses_a_graph_without_fused_layer_norms(tiny_entry: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model.onnx has no SkipLayerNormalization: write the CPU graph from"):
        layer_norms.cpu_graph(tiny_entry / "model.onnx", tmp_path / "cpu.onnx")
    assert not (tmp_path / "cpu.onnx").exists()


def test_attention_packs_the_models_own_weights_and_masks_padding_as_it_does(tiny_entry: Path) -> None:
    """Attention's packed weight is [W_q | W_k | W_v] of the model (x @ W: the transposes of nn.Linear's), its
    mask the raw attention_mask, and padded keys get the model's fill value, finfo(float32).min."""
    model = random_encoder(EncoderConfig(**TINY), seed=7)  # type: ignore[arg-type]
    g = _graph(tiny_entry / "model.optimized.onnx")
    weights = {t.name: numpy_helper.to_array(t) for t in g.graph.initializer}
    producers = {o: n for n in g.graph.node for o in n.output}
    attentions = [n for n in g.graph.node if n.op_type == "Attention"]
    for node, layer in zip(attentions, model.blocks(), strict=True):
        attn = layer.attn
        want_w = np.concatenate([lin.weight.detach().numpy().T for lin in (attn.q, attn.k, attn.v)], axis=1)
        want_b = np.concatenate([lin.bias.detach().numpy() for lin in (attn.q, attn.k, attn.v)])
        np.testing.assert_array_equal(weights[node.input[1]], want_w)
        np.testing.assert_array_equal(weights[node.input[2]], want_b)
        cast = producers[node.input[3]]
        assert (cast.op_type, list(cast.input)) == ("Cast", ["attention_mask"])
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["num_heads"] == TINY["n_heads"]
        assert attrs["mask_filter_value"] == np.finfo(np.float32).min
    (embed,) = [n for n in g.graph.node if n.op_type == "EmbedLayerNormalization"]
    np.testing.assert_array_equal(weights[embed.input[2]], model.embeddings.tokens.weight.detach().numpy())
    positions = model.embeddings.positions
    assert positions is not None
    # token type 0 is added into the position table once, at export
    want_pos = positions.weight.detach().numpy() + model.embeddings.token_type.weight.detach().numpy()[0]
    np.testing.assert_allclose(weights[embed.input[3]], want_pos, rtol=0, atol=0)


@pytest.mark.slow
def test_fusions_hold_for_sinusoidal_positions_and_cls_pooling(tmp_path: Path) -> None:
    """The other encoder options: a constant sinusoid table instead of learned positions, [CLS] pooling."""
    sizes: dict[str, object] = {**TINY, "positional": "sinusoidal", "pooling": "cls"}
    entry = export_entry(
        ExportOptions(source="random", repository=tmp_path, name="s", random_config=sizes, seed=3, optimize=True),
        out=io.StringIO(),
    )
    g = _graph(entry / "model.optimized.onnx")
    types = Counter(n.op_type for n in g.graph.node)
    # [CLS] pooling: one Gather of position 0 instead of the mean's nodes
    assert dict(types) == fused_node_types(TINY["n_layers"], {"Gather": 1})
    # the gate ran and passed; run it once more here, through the serving engine
    model = random_encoder(EncoderConfig(**sizes), seed=3)  # type: ignore[arg-type]
    engine = OnnxEngine(entry / "model.optimized.onnx", max_seq_len=160, vocab_size=256, device="cpu")
    report = parity.check(model, engine)
    assert report.passed, report.max_abs_diff


@pytest.mark.slow
def test_fused_and_int8_graphs_are_reproducible(tiny_entry: Path, tmp_path: Path) -> None:
    """The same code and weights publish the same bytes (the sha256 a server checks does not drift)."""
    again = export_entry(
        ExportOptions(source="random", repository=tmp_path, name="tiny", random_config=dict(TINY), seed=7, int8=True),
        out=io.StringIO(),
    )
    for variant in ("model.optimized.onnx", "model.optimized-cpu.onnx", "model.int8.onnx"):
        assert (again / variant).read_bytes() == (tiny_entry / variant).read_bytes(), variant
