"""The int8 CPU graph: dynamic int8 quantisation of the fused graph's matrix products, with per-row scaling.

ONNX Runtime's dynamic quantisation (`DynamicQuantizeMatMul`, `QAttention`) quantises an activation with
one scale for the whole tensor, computed at run time from its minimum and maximum. In BERT-family encoders a
few tokens (the [CLS] token above all) carry activations ten times larger than the rest: one scale for the
whole batch then leaves the other tokens a handful of levels, and a short text, or a text padded into a batch
of long ones, loses most of its precision. Weights are quantised per output channel (int8, symmetric).

Per-row scaling keeps ONNX Runtime's fast kernel and gives each token its own range: for a chosen MatMul,

    Y = MatMul(X / r, W) * r,    r = max |X| over each row (each token),

which is the same product in fp32, and under per-tensor quantisation makes every row span the full int8
range. It costs five cheap elementwise nodes before the product and one after. `Int8Plan` chooses which
products get it and which stay in fp32 (mixed precision); docs/benchmarks.md has the measurements behind the
default.

Fixed ranges: ONNX Runtime's dynamic quantisation takes each activation's range from the whole batch at run
time, so an input's vector depended on the others it was batched with (up to 3e-2; a short text batched with
one other fell to cosine 0.978 of fp32, below the gate's 0.98, in arrangements the gate did not try). Every
activation is quantised over a range fixed at export instead (`QuantizeLinear` with constants in place of
`DynamicQuantizeLinear`): a row-scaled one over [-1, 1] (after the GELU, whose output is never below -0.17,
over [-0.203, 1]: twice the levels, the negative tail of a row whose largest value is small clipped), the others
(the QKV projection's input, the attention output) over the range they reach on a calibration set of real texts
(export/gate/calibration.json, none of them the gate's). An input's vector then is the same, to fp32 rounding,
in every batch, and the gate's figures hold for every arrangement; it costs no time (no pass over the activation
for its range). An input unlike any calibration text can overshoot a calibrated range and be clipped: a run of
64 periods fell to 0.9789 alone, where per-batch ranges gave it its own (0.9850); a calibration set widened
with such texts lowered the gate's worst instead (docs/benchmarks.md).

The layer norms are written out as plain operators (export/layer_norms.py, as in the CPU fp32 graph). ONNX
Runtime's CPU kernel for (Skip)LayerNormalization (1.31) ran 2-3x slower than the same arithmetic in eleven
elementwise and reduction nodes, and the rewrite made the whole int8 graph 4-19 % faster (docs/benchmarks.md,
"int8 on a CPU with VNNI").
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from mhaserve.export.fusions import MS
from mhaserve.export.layer_norms import Nodes, plain_layer_norms
from mhaserve.runtime import external_data

# The roles of a layer's matrix products, in the order they run.
ROLES = ("qkv", "attn_out", "ffn_up", "ffn_down")
WeightType = Literal["int8", "uint8"]


@dataclass(frozen=True)
class Int8Plan:
    """How the fused graph is quantised. Products are named `<layer>.<role>`, e.g. `0.ffn_down`, `*` any."""

    # Products that get per-row scaling (`*.ffn_down`, or `*` for every MatMul; the packed QKV product
    # inside Attention cannot: its rows feed the softmax, which a per-row factor does not commute with).
    # The feed-forward products need it: on all-MiniLM-L6-v2, scaling only the second leaves a min cosine
    # of 0.971, scaling both 0.983 (every MatMul: 0.983 too); the attention output's rows, averages of
    # value vectors, have no outlier token, and leaving it out saves 30 nodes and 1-5 % of the time
    # (docs/benchmarks.md, "Graphs: fused and int8").
    row_scaled: tuple[str, ...] = ("*.ffn_up", "*.ffn_down")
    # Products left in fp32.
    keep_fp32: tuple[str, ...] = ()
    # int8 weights with uint8 activations use the CPU's fastest int8 instructions, but on x86 CPUs without
    # VNNI (AVX2, AVX-512 before Cascade Lake) they add products in pairs into int16, which saturates for
    # large weights times large activations; VNNI CPUs do not: the same graph computes differently per CPU.
    # Weights of 7 bits (`reduce_range`, |w| <= 64: 255 * 64 * 2 fits in int16) never saturate, so the
    # gate's figures hold on every CPU, at the same speed. uint8 weights do not saturate either, but run a
    # slower kernel.
    weights: WeightType = "int8"
    reduce_range: bool = True
    per_channel: bool = True
    # SkipLayerNormalization as plain operators (see the module's docstring): faster on ONNX Runtime's CPU.
    plain_layer_norm: bool = True
    # Activations quantised over ranges fixed at export, not per batch (see the module's docstring).
    fixed_ranges: bool = True
    # With fixed ranges, each product's int8 MatMul, its cast to fp32 and its scaling as one node (see
    # `_to_float`): the same numbers, 1-5 % faster. Without fixed ranges ONNX Runtime fuses that chain itself.
    to_float: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULT_PLAN = Int8Plan()


@dataclass
class Product:
    """One matrix product of the fused graph: a MatMul or the QKV projection inside an Attention node."""

    layer: int
    role: str
    node: ir.Node

    @property
    def label(self) -> str:
        return f"{self.layer}.{self.role}"

    def matches(self, patterns: tuple[str, ...]) -> bool:
        return any(_match(self.label, p) for p in patterns)


def _match(label: str, pattern: str) -> bool:
    if pattern == "*":
        return True
    layer, _, role = label.partition(".")
    p_layer, _, p_role = pattern.partition(".")
    return p_layer in ("*", layer) and p_role in ("*", role)


def products(graph: ir.Graph) -> list[Product]:
    """The products with constant weights of a fused encoder graph, labelled by layer and role."""
    found: list[Product] = []
    layer = -1
    for node in graph:
        if node.op_type == "Attention" and node.domain == MS:
            layer += 1
            found.append(Product(layer, "qkv", node))
        elif node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.inputs[1] is not None:
            if node.inputs[1].const_value is None or layer < 0:
                continue
            src = node.inputs[0].producer() if node.inputs[0] is not None else None
            users = {u.node.op_type for u in node.outputs[0].uses()}
            if src is not None and src.op_type == "Attention":
                role = "attn_out"
            elif src is not None and src.op_type in ("BiasGelu", "Gelu", "FastGelu"):
                role = "ffn_down"
            elif users & {"BiasGelu", "Gelu", "FastGelu"}:
                role = "ffn_up"
            else:
                continue
            found.append(Product(layer, role, node))
    return found


# GELU (erf) is never below -0.17: max(max(X), 0.17) bounds |X| of its output without computing |X|.
_GELU_FLOOR = 0.17


def _row_scale(graph: ir.Graph, product: Product, constants: dict[str, ir.Value]) -> None:
    """Replace `X @ W` by `(X * (1 / r)) @ W * r`, r the row-wise max |X|, floored against an all-zero row.

    After a GELU, r = max(max X, 0.17) bounds |X| as well and saves a pass over the widest activation.
    The reciprocal is of one value per row, and a Mul over the row does less than a Div (docs/benchmarks.md,
    "int8 on a CPU with VNNI": within the noise there, kept for that).
    """
    old = product.node
    x, w = old.inputs[0], old.inputs[1]
    stem = f"rowscale_{product.layer}_{product.role}"
    nodes = Nodes(stem)
    after_gelu = product.role == "ffn_down"
    rmax = nodes.op("ReduceMax", [x if after_gelu else nodes.op("Abs", [x]), constants["axes"]], keepdims=1)
    r = nodes.op("Max", [rmax, constants["gelu_floor" if after_gelu else "eps"]])
    xn = nodes.op("Mul", [x, nodes.op("Reciprocal", [r])])
    matmul = ir.Node("", "MatMul", [xn, w], name=old.name, num_outputs=1)
    matmul.outputs[0].name = f"{stem}_product"
    y = nodes.op("Mul", [nodes.add(matmul), r])
    y.type, y.shape = old.outputs[0].type, old.outputs[0].shape
    graph.insert_before(old, nodes.made)
    old.outputs[0].replace_all_uses_with(y)
    graph.remove(old, safe=True)
    product.node = matmul


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """ONNX Runtime's quantiser logs advice on the root logger and warns about pre-processing."""
    root = logging.getLogger()
    level = root.level
    try:
        root.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


@dataclass
class QuantizeReport:
    """What was quantised and how: recorded in the manifest beside the gate's figures."""

    plan: dict[str, Any]
    int8: list[str] = field(default_factory=list)
    row_scaled: list[str] = field(default_factory=list)
    fp32: list[str] = field(default_factory=list)
    plain_layer_norms: int = 0
    # each activation quantised over a fixed range, by the tensor's name: [low, high]
    fixed_ranges: dict[str, list[float]] = field(default_factory=dict)
    calibration_inputs: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def quantize(
    src: Path, dst: Path, plan: Int8Plan = DEFAULT_PLAN, calibration: Sequence[Sequence[int]] = ()
) -> QuantizeReport:
    """Write `dst`, the int8 graph of the fused fp32 graph `src`, as `plan` says; `calibration` (token ids of
    real texts, one input each) sets the fixed ranges of the activations that are not row-scaled."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = ir.load(str(src))
    graph = model.graph
    found = products(graph)
    if not any(p.role == "qkv" for p in found):
        raise ValueError(f"{src.name} has no fused Attention: quantise the fused (--optimize) graph")
    # the plan as it was carried out: without fixed ranges there is no chain of ours to make one node
    report = QuantizeReport(plan=plan.to_dict() | {"to_float": plan.to_float and plan.fixed_ranges})
    constants: dict[str, npt.NDArray[np.generic]] = {
        "axes": np.array([-1], dtype=np.int64),
        "eps": np.array(1e-6, dtype=np.float32),
        "gelu_floor": np.array(_GELU_FLOOR, dtype=np.float32),
    }
    values = {
        k: ir.Value(name=f"rowscale_{k}", const_value=ir.tensor(v, name=f"rowscale_{k}")) for k, v in constants.items()
    }
    exclude: list[str] = []
    for p in found:
        if p.matches(plan.keep_fp32):
            report.fp32.append(p.label)
            exclude.append(p.node.name or "")
            continue
        report.int8.append(p.label)
        if p.role != "qkv" and p.matches(plan.row_scaled):
            if not report.row_scaled:
                for v in values.values():
                    graph.register_initializer(v)
            _row_scale(graph, p, values)
            report.row_scaled.append(p.label)
    if plan.fixed_ranges and report.int8 and not calibration:
        raise ValueError("fixed ranges need a calibration set")
    if plan.plain_layer_norm:
        report.plain_layer_norms = plain_layer_norms(graph)
    common_passes.RemoveUnusedNodesPass()(model)  # and the constants no product needed
    # A graph past the protobuf's 2 GiB keeps its weights in a file beside it (onnx_graph.export_graph). The
    # staged copy must carry its own (it lives in another folder, and the quantiser reads the data), and the
    # int8 graph keeps its weights beside it too: model.int8.onnx.data, listed in the manifest as any other.
    big = bool(external_data.locations(src))
    with tempfile.TemporaryDirectory() as tmp, _quiet():
        staged = Path(tmp) / "staged.onnx"
        ir.save(model, str(staged), external_data="staged.onnx.data" if big else None)
        quantize_dynamic(
            staged,
            dst,
            use_external_data_format=big,
            op_types_to_quantize=["MatMul", "Attention"],
            per_channel=plan.per_channel,
            reduce_range=plan.reduce_range,
            weight_type=QuantType.QInt8 if plan.weights == "int8" else QuantType.QUInt8,
            nodes_to_exclude=exclude,
        )
    if plan.fixed_ranges and report.int8:
        report.fixed_ranges = _fix_ranges(dst, calibration, to_float=plan.to_float)
        report.calibration_inputs = len(calibration)
    return report


# A row-scaled activation's fixed range: within [-1, 1]; after the GELU, within [-0.17 / r, 1] with r >= 0.17 the
# row's largest value. A zero point of 43 gives [-43/212, 1] = [-0.203, 1]: a row whose r is below 0.85 has its
# GELU's negative tail clipped there (on all-MiniLM-L6-v2 the last layer's [CLS] row, r about 0.41, down to
# -0.41: a quarter of that row's values), but the levels it gives the positive values weigh more on the gate:
# min cosine 0.9824 with it against 0.9801 over [-1, 1], the other ranges the same (docs/benchmarks.md).
_ROW_SCALED = (1 / 127, 128)
_ROW_SCALED_AFTER_GELU = (1 / 212, 43)


def _fix_ranges(path: Path, calibration: Sequence[Sequence[int]], *, to_float: bool) -> dict[str, list[float]]:
    """Replace each DynamicQuantizeLinear of the int8 graph at `path` by a QuantizeLinear over a fixed range (the
    module's docstring), and with `to_float` each product's chain by one node (`_to_float`), in place; the ranges,
    by tensor name."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)  # a big graph's weights stay in their file
    dynamic = [n for n in model.graph.node if n.op_type == "DynamicQuantizeLinear"]
    scaled = {n.input[0] for n in dynamic if n.input[0].startswith("rowscale_")}
    ranges = _calibrate(path, model, [n.input[0] for n in dynamic if n.input[0] not in scaled], calibration)
    fixed: dict[str, tuple[float, int]] = {}
    for name, (low, high) in ranges.items():
        scale = (high - low) / 255 or 1.0  # an activation always 0: any scale
        fixed[name] = (scale, min(255, max(0, round(-low / scale))))
    for name in scaled:  # rowscale_<layer>_<role>_<n>_Mul
        fixed[name] = _ROW_SCALED_AFTER_GELU if name.split("_")[2:4] == ["ffn", "down"] else _ROW_SCALED
    nodes = []
    for n in model.graph.node:
        if n.op_type != "DynamicQuantizeLinear":
            nodes.append(n)
            continue
        scale, zero = fixed[n.input[0]]
        model.graph.initializer.extend(
            [
                numpy_helper.from_array(np.array(scale, dtype=np.float32), n.output[1]),
                numpy_helper.from_array(np.array(zero, dtype=np.uint8), n.output[2]),
            ]
        )
        nodes.append(helper.make_node("QuantizeLinear", [n.input[0], n.output[1], n.output[2]], [n.output[0]], n.name))
    del model.graph.node[:]
    model.graph.node.extend(_to_float(nodes) if to_float else nodes)
    onnx.save(model, str(path))
    return {name: [(0 - zero) * scale, (255 - zero) * scale] for name, (scale, zero) in sorted(fixed.items())}


def _to_float(nodes: list[Any]) -> list[Any]:
    """Each `MatMulInteger -> Cast -> Mul(activation scale * weight scales)` as one `MatMulIntegerToFloat`.

    ONNX Runtime fuses that chain itself only behind a DynamicQuantizeLinear (into DynamicQuantizeMatMul); behind
    a QuantizeLinear of a fixed range it ran the three nodes, the int32 product written out, read back as fp32
    and scaled in two more passes over it. The fused kernel scales the int32 sums as it writes them: the same
    arithmetic (the vectors are bit-identical), 1-5 % faster in process on all-MiniLM-L6-v2 (docs/benchmarks.md,
    "The int8 products as one node"). `nodes` in graph order; the scales' Mul, constant now, goes with it.
    """
    import onnx
    from onnx import helper

    made = {out: n for n in nodes for out in n.output}
    users: dict[str, list[Any]] = {}
    for n in nodes:
        for name in n.input:
            users.setdefault(name, []).append(n)

    def only_user(name: str, op_type: str) -> Any:
        found = users.get(name, [])
        return found[0] if len(found) == 1 and found[0].op_type == op_type else None

    fused: dict[int, Any] = {}
    dropped: set[int] = set()
    for n in nodes:
        if n.op_type != "MatMulInteger" or len(n.input) != 4:
            continue
        a, b, a_zero, b_zero = n.input
        quantized = made.get(a)
        cast = only_user(n.output[0], "Cast")
        if cast is None or [x.i for x in cast.attribute if x.name == "to"] != [onnx.TensorProto.FLOAT]:
            continue
        mul = only_user(cast.output[0], "Mul")
        scales = mul and made.get(next((i for i in mul.input if i != cast.output[0]), ""))
        if quantized is None or quantized.op_type != "QuantizeLinear" or scales is None:
            continue  # an activation quantised at run time, or not the chain quantize_dynamic writes
        # the scales' product as quantize_dynamic writes it, of the activation's (a constant) and the weight's
        a_scale, b_scale = quantized.input[1], b.removesuffix("_quantized") + "_scale"
        if (
            scales.op_type != "Mul"
            or sorted(scales.input) != sorted((a_scale, b_scale))
            or len(users[scales.output[0]]) != 1
        ):
            continue
        fused[id(n)] = helper.make_node(
            "MatMulIntegerToFloat", [a, b, a_scale, b_scale, a_zero, b_zero], [mul.output[0]], n.name, domain=MS
        )
        dropped |= {id(cast), id(mul), id(scales)}
    return [fused.get(id(n), n) for n in nodes if id(n) not in dropped]


def _calibrate(
    path: Path, model: Any, names: list[str], calibration: Sequence[Sequence[int]]
) -> dict[str, tuple[float, float]]:
    """The range each named activation reaches over the calibration inputs, run one at a time (no padding), 0
    included (so that 0 is a level of the range, as ONNX Runtime's own quantiser keeps it)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from mhaserve.runtime.manifest import INPUT_NAMES

    if not names:
        return {}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    # Beside the graph, whose weights file (a big graph's) its tensors name by a path relative to it.
    with tempfile.NamedTemporaryFile(suffix=".onnx", prefix=".calibrate-", dir=path.parent) as f:
        onnx.save(probe, f.name)
        session = ort.InferenceSession(f.name, providers=["CPUExecutionProvider"])
    low = dict.fromkeys(names, 0.0)
    high = dict.fromkeys(names, 0.0)
    for ids in calibration:
        row = np.array([ids], dtype=np.int64)
        values = session.run(names, {INPUT_NAMES[0]: row, INPUT_NAMES[1]: np.ones_like(row)})
        for name, value in zip(names, values, strict=True):
            low[name], high[name] = min(low[name], float(value.min())), max(high[name], float(value.max()))
    return {n: (low[n], high[n]) for n in names}
