"""The int8 graph (`--int8`): how it is quantised, its gate (which a damaged quantisation fails), serving it."""

from __future__ import annotations

import io
import logging
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from mhaserve.export import int8_gate, quantize
from mhaserve.export.publish import ExportError, ExportOptions, export_entry
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.runtime import int8_kernels
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.manifest import read_manifest
from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.service.settings import Settings
from mhaserve.testing.loopback import WAIT
from mhaserve.testing.server import ServerThread
from tests.conftest import TINY

L = TINY["n_layers"]


def _engine(path: Path) -> OnnxEngine:
    return OnnxEngine(path, max_seq_len=TINY["max_seq_len"], vocab_size=TINY["vocab_size"], device="cpu")


def _initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def damage(path: Path, name: str, factor: float) -> None:
    """Force one weight scale of an int8 graph wrong, in place (a quantiser bug that still makes a valid graph)."""
    g = onnx.load(str(path))
    (init,) = [t for t in g.graph.initializer if t.name == name]
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(factor), name))
    onnx.save(g, str(path))


def test_every_product_is_int8_with_reduced_range_per_channel_weights(tiny_entry: Path) -> None:
    g = onnx.load(str(tiny_entry / "model.int8.onnx"))
    types = Counter(n.op_type for n in g.graph.node)
    # the other products each one node, scaled to fp32 as the int32 sums are written (`_to_float`)
    assert types["QAttention"] == L and types["MatMulIntegerToFloat"] == 3 * L and "MatMulInteger" not in types
    assert "MatMul" not in types and "Attention" not in types  # nothing left in fp32
    # per-row scaling around both feed-forward MatMuls: X * (1 / r) before, * r after; after the GELU, no Abs
    assert types["ReduceMax"] == types["Max"] == 2 * L and types["Abs"] == L
    assert types["Div"] == 1  # the mean pooling's; the row scaling divides nothing
    # the layer norms in plain operators (ONNX Runtime's CPU kernel for them is the slow one)
    assert "SkipLayerNormalization" not in types and types["Sqrt"] == 2 * L
    assert types["Reciprocal"] == 2 * L + 2 * L  # one per layer norm, one per row-scaled product
    weights = _initializers(tiny_entry / "model.int8.onnx")
    quantised = [w for name, w in weights.items() if name.endswith("_quantized")]
    assert len(quantised) == 4 * L
    for w in quantised:
        # reduce_range: |w| <= 64, so a pair of uint8 x int8 products (255 * 64 * 2 = 32640) fits in int16
        assert w.dtype == np.int8 and np.abs(w.astype(np.int32)).max() <= 64
    qkv_scales = weights["Attention_0.qkv_weight_scale"]
    assert qkv_scales.shape == (3 * TINY["d_model"],)  # one scale per output channel
    # every activation quantised over a range fixed at export: the QKV input and the attention output of each
    # layer by the calibration set's, the two row-scaled ones by theirs
    assert "DynamicQuantizeLinear" not in types and types["QuantizeLinear"] == 4 * L
    how = read_manifest(tiny_entry).graphs["int8"].parity["quantization"]
    assert how["calibration_inputs"] == len(int8_gate.calibration_texts()) == 500
    ranges = how["fixed_ranges"]
    assert len(ranges) == 4 * L and all(low < 0 < high for low, high in ranges.values())
    scaled = {name: r for name, r in ranges.items() if name.startswith("rowscale_")}
    assert sorted(np.round(r, 3).tolist() for r in scaled.values()) == [[-1.008, 1.0]] * L + [[-0.203, 1.0]] * L
    assert sorted(how["int8"]) == sorted(f"{i}.{r}" for i in range(L) for r in quantize.ROLES)
    assert sorted(how["row_scaled"]) == sorted(f"{i}.{r}" for i in range(L) for r in ("ffn_up", "ffn_down"))
    assert (
        how["plan"]["reduce_range"]
        and how["plan"]["to_float"]
        and how["fp32"] == []
        and how["plain_layer_norms"] == 2 * L
    )


def test_an_int8_vector_does_not_depend_on_its_batch(tiny_entry: Path, tmp_path: Path) -> None:
    """Dynamic quantisation took each activation's range from the whole batch: a text's vector moved with the
    others batched with it (a short text beside one other fell below the gate's 0.98 on all-MiniLM-L6-v2). With
    ranges fixed at export, alone and in any batch it is the same to fp32 rounding."""
    tok = load_for_serving(tiny_entry / "tokenizer.json", TINY["max_seq_len"])
    texts = ["Ok.", "Thanks, that works.", "why is the sky blue", "a longer text about the weather " * 6, "?"]
    rows = [tok.encode(t).ids for t in texts]

    def moved(path: Path) -> float:
        """The most a vector moves between alone and each batch of it with the others (padded to their width)."""
        eng = _engine(path)
        alone = [eng.run(np.array([r]), np.ones((1, len(r)), np.int64))[0] for r in rows]
        worst = 0.0
        for i, r in enumerate(rows):
            for other in rows[:i] + rows[i + 1 :]:
                width = max(len(r), len(other))
                ids, mask = np.zeros((2, width), np.int64), np.zeros((2, width), np.int64)
                for j, row in enumerate((r, other)):
                    ids[j, : len(row)], mask[j, : len(row)] = row, 1
                worst = max(worst, float(np.abs(eng.run(ids, mask)[0] - alone[i]).max()))
        return worst

    assert moved(tiny_entry / "model.int8.onnx") < 1e-6  # float rounding (3e-7 here)
    # the same graph with the ranges taken per batch, as ONNX Runtime's dynamic quantisation does
    dynamic = tmp_path / "dynamic.onnx"
    how = quantize.quantize(tiny_entry / "model.optimized.onnx", dynamic, quantize.Int8Plan(fixed_ranges=False))
    assert moved(dynamic) > 1e-4
    assert how.plan["to_float"] is False  # no chain of its own to make one node: the manifest says what was done


def test_fixed_ranges_need_a_calibration_set(tiny_entry: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="calibration set"):
        quantize.quantize(tiny_entry / "model.optimized.onnx", tmp_path / "m.onnx")


def test_plain_layer_norms_compute_what_the_fused_kernel_does(tiny_entry: Path, tmp_path: Path) -> None:
    """Every product kept fp32 and no row scaling: the only change is the layer norms, so the graph must
    match the fused graph to fp32 rounding, on padded batches too."""
    fused = tiny_entry / "model.optimized.onnx"
    plain = tmp_path / "plain.onnx"
    how = quantize.quantize(fused, plain, quantize.Int8Plan(row_scaled=(), keep_fp32=("*",)))
    assert how.plain_layer_norms == 2 * L and how.int8 == []
    types = Counter(n.op_type for n in onnx.load(str(plain)).graph.node)
    assert "SkipLayerNormalization" not in types and types["ReduceMean"] == 4 * L
    rng = np.random.default_rng(0)
    fused_engine, plain_engine = _engine(fused), _engine(plain)
    for batch, seq in ((1, 5), (3, 17), (4, TINY["max_seq_len"])):
        ids = rng.integers(1, TINY["vocab_size"], size=(batch, seq))
        mask = np.ones_like(ids)
        mask[0, seq // 2 :] = 0  # a padded row
        want = fused_engine.run(ids, mask)
        np.testing.assert_allclose(plain_engine.run(ids, mask), want, atol=1e-5)
    # the point of the rewrite: ONNX Runtime's session must not fuse the pattern back into its slow kernel
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "as_loaded.onnx")
    ort.InferenceSession(str(tiny_entry / "model.int8.onnx"), opts, providers=["CPUExecutionProvider"])
    loaded = Counter(n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node)
    assert not {"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization"} & set(loaded)
    kept = quantize.quantize(fused, tmp_path / "kept.onnx", quantize.Int8Plan(keep_fp32=("*",), plain_layer_norm=False))
    assert kept.plain_layer_norms == 0
    assert (
        Counter(n.op_type for n in onnx.load(str(tmp_path / "kept.onnx")).graph.node)["SkipLayerNormalization"] == 2 * L
    )


def test_a_plan_keeps_products_in_fp32(tiny_entry: Path, tmp_path: Path) -> None:
    """Mixed precision: the products a plan names stay fp32 MatMuls (and Attention), the rest int8."""
    plan = quantize.Int8Plan(row_scaled=("*.ffn_down",), keep_fp32=("0.*", "1.ffn_up"))
    how = quantize.quantize(tiny_entry / "model.optimized.onnx", tmp_path / "m.onnx", plan, calibration=[[2, 7, 9, 3]])
    assert sorted(how.fp32) == ["0.attn_out", "0.ffn_down", "0.ffn_up", "0.qkv", "1.ffn_up"]
    assert len(how.fixed_ranges) == 3  # the activations of the int8 products only: qkv, attn_out, ffn_down
    assert how.row_scaled == ["1.ffn_down"]
    types = Counter(n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node)
    assert (types["MatMul"], types["Attention"], types["MatMulIntegerToFloat"], types["QAttention"]) == (4, 1, 2, 1)


def test_a_product_as_one_node_computes_what_its_chain_did(tiny_entry: Path, tmp_path: Path) -> None:
    """`MatMulIntegerToFloat` in place of MatMulInteger -> Cast -> Mul: the same numbers to the last bit, on
    padded batches, and nothing of the chain left for ONNX Runtime to run."""
    src, calibration = tiny_entry / "model.optimized.onnx", [[2, 7, 9, 3], [5, 11, 4, 8, 6, 12, 3]]
    chain, one = tmp_path / "chain.onnx", tmp_path / "one.onnx"
    quantize.quantize(src, chain, quantize.Int8Plan(to_float=False), calibration=calibration)
    quantize.quantize(src, one, quantize.Int8Plan(), calibration=calibration)
    before = Counter(n.op_type for n in onnx.load(str(chain)).graph.node)
    after = Counter(n.op_type for n in onnx.load(str(one)).graph.node)
    assert before["MatMulInteger"] == after["MatMulIntegerToFloat"] == 3 * L and "MatMulInteger" not in after
    # each product's Cast, its Mul by the scales and the Mul that made the scales' product, gone
    assert before["Cast"] - after["Cast"] == 3 * L and before["Mul"] - after["Mul"] == 6 * L
    rng = np.random.default_rng(1)
    chain_engine, one_engine = _engine(chain), _engine(one)
    for batch, seq in ((1, 5), (3, 17), (4, TINY["max_seq_len"])):
        ids = rng.integers(1, TINY["vocab_size"], size=(batch, seq))
        mask = np.ones_like(ids)
        mask[0, seq // 2 :] = 0
        np.testing.assert_array_equal(one_engine.run(ids, mask), chain_engine.run(ids, mask))


def test_the_gate_figures_are_in_the_manifest(tiny_entry: Path) -> None:
    figures = read_manifest(tiny_entry).graphs["int8"].parity
    assert figures["passed"]
    assert figures["min_cosine"] >= int8_gate.MIN_COSINE and figures["mean_cosine"] >= int8_gate.MEAN_COSINE
    assert figures["thresholds"] == {
        "min_cosine": 0.98,
        "mean_cosine": 0.995,
        "top1_agreement": 0.95,
        "top10_overlap": 0.9,
    }
    retrieval = figures["retrieval"]
    items = int8_gate.retrieval_set()
    assert retrieval["queries"] == len(items) >= 50
    assert retrieval["passages"] == sum(len(p) for _, p in items) >= 5 * len(items)
    assert retrieval["top1_agreement"] >= 0.95 and retrieval["top10_overlap"] >= 0.9
    # every input alone and in a batch: the parity grid's rows and the real texts
    n_texts = len(int8_gate.fidelity_texts()) + retrieval["queries"] + retrieval["passages"]
    assert figures["sets"]["texts_alone"]["inputs"] == figures["sets"]["texts_batched"]["inputs"] == n_texts
    assert figures["sets"]["grid_alone"]["inputs"] == figures["sets"]["grid_batched"]["inputs"] > 100
    assert figures["inputs"] == n_texts + figures["sets"]["grid_alone"]["inputs"]


def test_the_manifest_records_each_cpu_graphs_speed_against_the_plain_graph(tiny_entry: Path) -> None:
    graphs = read_manifest(tiny_entry).graphs
    assert "speed_at_export" not in graphs["fp16"].parity  # for CUDA hosts: not measured on the CPU
    for variant in ("fp32", "optimized", "optimized-cpu", "int8"):
        figures = graphs[variant].parity["speed_at_export"]
        assert figures["relative_to"] == "fp32"
        for workload in ("short", "mixed"):
            assert figures[workload]["speed"] > 0 and figures[workload]["seq_per_s"] > 0
            assert figures[workload]["inputs"] == graphs["fp32"].parity["speed_at_export"][workload]["inputs"] > 0
    assert graphs["fp32"].parity["speed_at_export"]["short"]["speed"] == 1.0
    # the int8 figure names the CPU's int8 kernels that made it (AMX, AVX-512 VNNI, AVX2...)
    assert graphs["int8"].parity["speed_at_export"]["int8_kernel"] == int8_kernels.describe()
    assert "int8_kernel" not in graphs["optimized"].parity["speed_at_export"]


def test_the_gate_measures_the_damage_of_a_wrong_scale(tiny_entry: Path, tmp_path: Path) -> None:
    """The same graph, one weight scale forced 10x: the gate's figures fall below its bar."""
    reference = _engine(tiny_entry / "model.optimized.onnx")
    tok = load_for_serving(tiny_entry / "tokenizer.json", TINY["max_seq_len"])
    kw = {"max_seq_len": TINY["max_seq_len"], "vocab_size": TINY["vocab_size"], "pad_id": 0}
    bad = tmp_path / "bad.onnx"
    bad.write_bytes((tiny_entry / "model.int8.onnx").read_bytes())
    damage(bad, "Attention_0.qkv_weight_scale", 10.0)
    report = int8_gate.check(reference, _engine(bad), tok, **kw)
    assert not report.passed and report.failures
    good = int8_gate.check(reference, _engine(tiny_entry / "model.int8.onnx"), tok, **kw)
    assert good.passed
    assert report.mean_cosine < good.mean_cosine
    with pytest.raises(int8_gate.Int8GateError, match="int8 gate failed"):
        report.require_passed()


def test_the_gate_fails_a_graph_that_answers_nan(tiny_entry: Path) -> None:
    """NaN compares false with every bound: a NaN row (inside padded batches here) would have passed the
    cosine bars; it counts as a cosine of -1."""
    reference = _engine(tiny_entry / "model.optimized.onnx")
    int8 = _engine(tiny_entry / "model.int8.onnx")
    tok = load_for_serving(tiny_entry / "tokenizer.json", TINY["max_seq_len"])

    class NanInBatches:
        providers = int8.providers

        def run(self, ids: np.ndarray, mask: np.ndarray, *, beside: bool = False) -> np.ndarray:
            out = int8.run(ids, mask)
            if len(out) > 1:
                out[-1] = np.nan
            return out

    report = int8_gate.check(
        reference, NanInBatches(), tok, max_seq_len=TINY["max_seq_len"], vocab_size=TINY["vocab_size"], pad_id=0
    )
    assert not report.passed and report.min_cosine == -1.0


def test_a_damaged_quantisation_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = quantize.quantize

    def wrong_scale(
        src: Path, dst: Path, plan: quantize.Int8Plan = quantize.DEFAULT_PLAN, calibration: Sequence[list[int]] = ()
    ) -> quantize.QuantizeReport:
        report = real(src, dst, plan, calibration)
        damage(dst, "Attention_0.qkv_weight_scale", 10.0)
        return report

    monkeypatch.setattr(quantize, "quantize", wrong_scale)
    opts = ExportOptions(source="random", repository=tmp_path, name="t", random_config=dict(TINY), seed=7, int8=True)
    with pytest.raises(ExportError, match=r"int8 gate failed: .*; nothing was published"):
        export_entry(opts, out=io.StringIO())
    assert list(tmp_path.iterdir()) == []  # no entry (not even its fp32 graphs), no scratch directory


def test_serve_graph_int8(tiny_entry: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`mhaserve serve --graph int8` serves model.int8.onnx; its embeddings are the fp32 graph's, nearly; its
    load line says which int8 kernels the CPU gave it."""
    caplog.set_level(logging.INFO, logger="mhaserve.runtime.repository")
    repo = tiny_entry.parent.parent
    assert ModelRepository(repo).entry("tiny", graph="auto", device="cpu").graph == "optimized-cpu"  # never int8
    texts = ["a short one", "Ok.", "a somewhat longer sentence about quantisation " * 3]
    srv = ServerThread(Settings(repository=repo, port=0, metrics_port=0, device="cpu", graph="int8")).ready()
    try:
        # --inference-workers auto: two for int8 on a CPU of two cores or more, the second on its own session
        engine = srv.server.dataplane.pipelines()[0].model.engine
        assert isinstance(engine, OnnxEngine)
        assert (engine.overlap_session is not None) == ((os.cpu_count() or 1) >= 2)
        with srv.channel() as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=WAIT)
            reply = stub.Encode(pb.EncodeRequest(texts=texts, normalize=True), timeout=WAIT)
    finally:
        srv.stop()
    entry = read_manifest(tiny_entry).graphs["int8"]
    assert (info.graph, info.sha256) == ("int8", entry.sha256)
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded tiny")]
    assert loaded and loaded[0].endswith(f"(int8 graph, sha256 {entry.sha256[:12]}…) on ['CPUExecutionProvider'], "
                                         f"int8 products on {int8_kernels.describe()}")  # fmt: skip
    got = np.array([e.values for e in reply.embeddings])
    tok = load_for_serving(tiny_entry / "tokenizer.json", TINY["max_seq_len"])
    fp32 = _engine(tiny_entry / "model.optimized.onnx")
    want = np.concatenate(
        [fp32.run(np.array([tok.encode(t).ids]), np.ones((1, len(tok.encode(t).ids)), np.int64)) for t in texts]
    )
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    assert (got * want).sum(axis=1).min() >= int8_gate.MIN_COSINE
