"""The fused graph's layer norms written out as plain operators: the CPU graph, and a step of the int8 graph.

ONNX Runtime's CPU kernel for SkipLayerNormalization (1.31) is a scalar loop with a division per element:
`perf` on one thread running the fused fp32 graph put 12 % of its samples there (docs/benchmarks.md, "A new
draw, an AMD EPYC Zen 5"). The same arithmetic in eleven or twelve elementwise and reduction nodes, which ONNX
Runtime vectorises, made the int8 graph 4-19 % faster, and the fused fp32 graph 7-15 % on one thread (Zen 5;
3-8 % on an Intel Xeon) and 9-12 % through the server (docs/benchmarks.md, "The fused graph for CPUs"). The fused
`optimized` graph keeps the fused node: CUDA serves it, and there the fused kernel is the fast one. So the
export writes the rewrite beside it as `optimized-cpu`, with its own parity gate, and `--graph auto` serves
it where the model runs on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir

from mhaserve.export.fusions import MS

FUSED = "SkipLayerNormalization"


class Nodes:
    """The standard-domain nodes of one rewrite, in the order they are made, named `<stem>_<n>_<op>`."""

    def __init__(self, stem: str) -> None:
        self.stem = stem
        self.made: list[ir.Node] = []

    def add(self, node: ir.Node) -> ir.Value:
        self.made.append(node)
        return node.outputs[0]

    def op(self, op_type: str, inputs: list[ir.Value | None], **attrs: int) -> ir.Value:
        name = f"{self.stem}_{len(self.made)}_{op_type}"
        node = ir.Node("", op_type, inputs, [ir.AttrInt64(k, v) for k, v in attrs.items()], name=name, num_outputs=1)
        node.outputs[0].name = name
        return self.add(node)


def plain_layer_norm(graph: ir.Graph, sln: ir.Node, index: int, axes: ir.Value) -> None:
    """Replace a SkipLayerNormalization by its arithmetic in standard operators.

    s = x + skip (+ bias); d = s - mean(s); y = d * (1 / sqrt(mean(d * d) + eps)) * gamma + beta.
    The reciprocal (of one value per row) and a Mul, not a Div over the whole row: cheaper, and a pattern
    ONNX Runtime's LayerNormFusion does not match, so the session does not fuse it back into the slow kernel.
    """
    stem = f"layernorm_{index}"
    eps_attr = sln.attributes.get("epsilon")
    eps = ir.Value(
        name=f"{stem}_eps",
        const_value=ir.tensor(
            np.array(eps_attr.as_float() if eps_attr else 1e-12, dtype=np.float32), name=f"{stem}_eps"
        ),
    )
    graph.register_initializer(eps)
    x, skip, gamma, beta = sln.inputs[:4]
    bias = sln.inputs[4] if len(sln.inputs) > 4 else None
    nodes = Nodes(stem)
    op = nodes.op

    s = op("Add", [x, skip])
    if bias is not None:
        s = op("Add", [s, bias])
    d = op("Sub", [s, op("ReduceMean", [s, axes], keepdims=1)])
    variance = op("ReduceMean", [op("Mul", [d, d]), axes], keepdims=1)
    inv_std = op("Reciprocal", [op("Sqrt", [op("Add", [variance, eps])])])
    y = op("Add", [op("Mul", [op("Mul", [d, inv_std]), gamma]), beta])
    out = sln.outputs[0]
    y.type, y.shape = out.type, out.shape
    graph.insert_before(sln, nodes.made)
    out.replace_all_uses_with(y)
    # outputs 1-2 (mean, inverse std) are for training; output 3 is the sum, which the next layer may take
    if len(sln.outputs) > 3:
        sln.outputs[3].replace_all_uses_with(s)
    if any(v.uses() for v in sln.outputs):
        raise ValueError(f"{sln.name}: its mean or inverse standard deviation is used; cannot rewrite it")
    graph.remove(sln, safe=True)


def plain_layer_norms(graph: ir.Graph) -> int:
    """Rewrite every SkipLayerNormalization of `graph` as plain operators; return how many there were."""
    found = [n for n in graph if n.op_type == FUSED and n.domain == MS]
    if found:
        axes = ir.Value(
            name="layernorm_axes", const_value=ir.tensor(np.array([-1], dtype=np.int64), name="layernorm_axes")
        )
        graph.register_initializer(axes)
        for i, node in enumerate(found):
            plain_layer_norm(graph, node, i, axes)
    return len(found)


def cpu_graph(src: Path, dst: Path) -> int:
    """Write `dst`, the fused graph `src` with its layer norms as plain operators; return how many it rewrote.

    Refuses a graph without any (nothing to gain: it is not a fused graph) and one that keeps any after the
    rewrite: the CPU graph's point is to have none."""
    model = ir.load(str(src))
    rewritten = plain_layer_norms(model.graph)
    if not rewritten:
        raise ValueError(f"{src.name} has no {FUSED}: write the CPU graph from the fused (--optimize) graph")
    left = sum(1 for n in model.graph if n.op_type == FUSED)
    if left:
        raise ValueError(f"{left} {FUSED} node(s) left after the rewrite")
    ir.save(model, str(dst))
    return rewritten
