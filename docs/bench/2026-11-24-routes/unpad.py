"""Prototype, measured and not taken: the fused MiniLM graph with its padding rows removed between layers.

usage: unpad.py FUSED.onnx OUT.onnx [attention|mha]

The token-wise nodes (the output projection, SkipLayerNormalization, the feed-forward) run on the real
tokens only, packed as (tokens, hidden) by a Gather on the mask's nonzero positions; each layer's
attention gets them back padded, (batch, sequence, hidden), by a Gather that maps padding to a zero row.
- attention: the fused Attention node stays, so its QKV projection still computes the padding rows.
- mha: the QKV projection runs packed too, then MultiHeadAttention on the padded Q, K and V.
"""

import sys

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx import helper as h

HIDDEN = 384


def unpad(src: str, dst: str, mode: str) -> None:
    model = onnx.load(src)
    graph = model.graph
    nodes = list(graph.node)
    embed = next(n for n in nodes if n.op_type == "EmbedLayerNormalization")
    x0 = embed.output[0]

    def const(name: str, value: np.ndarray) -> str:
        graph.initializer.append(numpy_helper.from_array(value, name))
        return name

    flat = const("unpad_flat_shape", np.array([-1], np.int64))
    rows = const("unpad_rows_shape", np.array([-1, HIDDEN], np.int64))
    zero = {HIDDEN: const("unpad_zero", np.zeros((1, HIDDEN), np.float32))}
    zero[3 * HIDDEN] = const("unpad_zero3", np.zeros((1, 3 * HIDDEN), np.float32))
    three = const("unpad_three", np.array([1, 1, 3], np.int64))
    one = const("unpad_one", np.array(1, np.int64))
    axis0 = const("unpad_axis0", np.array(0, np.int64))
    # idx: the real tokens' positions in the flattened batch; inv: each position's row among them, or the
    # zero row (index `total`) for padding.
    prepare = [
        h.make_node("Reshape", ["attention_mask", flat], ["unpad_mask"]),
        h.make_node("NonZero", ["unpad_mask"], ["unpad_nonzero"]),
        h.make_node("Reshape", ["unpad_nonzero", flat], ["unpad_idx"]),
        h.make_node("CumSum", ["unpad_mask", axis0], ["unpad_cum"]),
        h.make_node("Sub", ["unpad_cum", one], ["unpad_rank"]),
        h.make_node("ReduceSum", ["unpad_mask"], ["unpad_total"], keepdims=0),
        h.make_node("Cast", ["unpad_mask"], ["unpad_real"], to=TensorProto.BOOL),
        h.make_node("Where", ["unpad_real", "unpad_rank", "unpad_total"], ["unpad_inv"]),
        h.make_node("Shape", [x0], ["unpad_shape"]),
        h.make_node("Mul", ["unpad_shape", three], ["unpad_shape3"]),
    ]
    made = [0]

    def fresh(stem: str) -> str:
        made[0] += 1
        return f"unpad_{stem}{made[0]}"

    def pack(x: str) -> tuple[list[onnx.NodeProto], str]:
        r, out = fresh("r"), fresh("p")
        return [h.make_node("Reshape", [x, rows], [r]), h.make_node("Gather", [r, "unpad_idx"], [out], axis=0)], out

    def unpack(x: str, width: int = HIDDEN) -> tuple[list[onnx.NodeProto], str]:
        c, g, out = fresh("c"), fresh("g"), fresh("u")
        shape = "unpad_shape" if width == HIDDEN else "unpad_shape3"
        return [
            h.make_node("Concat", [x, zero[width]], [c], axis=0),
            h.make_node("Gather", [c, "unpad_inv"], [g], axis=0),
            h.make_node("Reshape", [g, shape], [out]),
        ], out

    packed: dict[str, str] = {}  # a padded tensor's packed replacement
    out: list[onnx.NodeProto] = []
    x0_packed = ""
    for n in nodes:
        if n is embed:
            out += [n, *prepare]
            more, x0_packed = pack(x0)
            out += more
            continue
        if n.op_type == "Attention":
            src = n.input[0]
            if mode == "mha":
                heads = next(a.i for a in n.attribute if a.name == "num_heads")
                qkv = fresh("qkv")
                out.append(h.make_node("MatMul", [x0_packed if src == x0 else src, n.input[1]], [qkv]))
                more, padded = unpack(qkv, 3 * HIDDEN)
                q, k, v = fresh("q"), fresh("k"), fresh("v")
                out += [*more, h.make_node("Split", [padded], [q, k, v], axis=2, num_outputs=3)]
                out.append(
                    h.make_node(
                        "MultiHeadAttention",
                        [q, k, v, n.input[2], n.input[3]],
                        [n.output[0]],
                        domain="com.microsoft",
                        num_heads=heads,
                    )
                )
            else:
                if src != x0:
                    more, n.input[0] = unpack(src)
                    out += more
                out.append(n)
            more, packed[n.output[0]] = pack(n.output[0])
            out += more
            continue
        for i, v in enumerate(n.input):
            if n.op_type == "SkipLayerNormalization" and v == x0:
                n.input[i] = x0_packed
            elif v in packed:
                n.input[i] = packed[v]
        if n.op_type == "Mul" and n.input[0].startswith("layer_norm_"):  # mean pooling: padded again
            more, n.input[0] = unpack(n.input[0])
            out += more
        out.append(n)
    del graph.node[:]
    graph.node.extend(out)
    del graph.value_info[:]
    onnx.save(model, dst)


if __name__ == "__main__":
    unpad(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "attention")
