"""The fusions ONNX Runtime's BERT optimizer makes and onnxscript's ORT fusions leave out, for our encoder.

onnxscript's `optimize_for_ort` turns a dynamo graph's attention into MultiHeadAttention over three
separate projections (Q, K and V each a MatMul and an Add) and leaves the embeddings as Gather, Slice,
Add, Add, LayerNormalization. ONNX Runtime's own optimizer, on a legacy export, goes further: one
`Attention` node per layer with the Q, K and V weights packed into one matrix (one GEMM instead of three,
and the bias and head split inside the kernel), and one `EmbedLayerNormalization`. It does not recognise
dynamo graphs, so these two rewrites do it here, on the graph `optimize_for_ort` returns.

Each rewrite matches a subgraph whose meaning it can check (constant weights, the padding mask built from
the `attention_mask` input, the position table sliced from row 0) and leaves anything else as it is; the
parity gate then checks the whole graph against the eager model.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from mhaserve.runtime.manifest import INPUT_NAMES

MS = "com.microsoft"


def fuse_encoder(model: ir.Model) -> dict[str, int]:
    """Rewrite in place; return how many of each fusion were made (dead nodes are removed after)."""
    fuser = _Fuser(model.graph)
    counts = {
        "embed_layer_norm": fuser.embeddings(),
        "packed_qkv_attention": fuser.attention(),
    }
    common_passes.RemoveUnusedNodesPass()(model)
    if any(counts.values()):
        model.opset_imports.setdefault(MS, 1)
    return counts


def _np(value: ir.Value | None) -> npt.NDArray[np.generic] | None:
    """The value of a constant (an initializer or a Constant node's output), or None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and node.domain == "" and "value" in node.attributes:
        tensor = node.attributes["value"].as_tensor()
        return tensor.numpy()
    return None


def _is(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The node of the standard domain that produces `value`, if it is an `op_type`."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _input(value: ir.Value | None, name: str) -> bool:
    return value is not None and value.is_graph_input() and value.name == name


def _same(a: npt.NDArray[np.generic] | None, want: list[int] | list[float]) -> bool:
    return a is not None and a.size == len(want) and bool((a.reshape(-1) == np.asarray(want)).all())


class _Fuser:
    def __init__(self, graph: ir.Graph) -> None:
        self.graph = graph
        self.casts: dict[str, ir.Value] = {}
        self.n_initializers = 0

    def _int32(self, name: str, before: ir.Node) -> ir.Value:
        """The graph input `name` cast to int32 (the contrib ops take int32 ids and masks), made once."""
        if name not in self.casts:
            source = next(v for v in self.graph.inputs if v.name == name)
            node = ir.Node(
                "",
                "Cast",
                [source],
                [ir.AttrInt64("to", ir.DataType.INT32)],
                name=f"{name}_int32",
                num_outputs=1,
            )
            out = node.outputs[0]
            out.name, out.dtype, out.shape = f"{name}_int32", ir.DataType.INT32, source.shape
            self.graph.insert_before(before, node)
            self.casts[name] = out
        return self.casts[name]

    def _initializer(self, stem: str, array: npt.NDArray[np.generic]) -> ir.Value:
        value = ir.Value(name=f"{stem}", const_value=ir.tensor(np.ascontiguousarray(array), name=stem))
        value.dtype = ir.DataType.from_numpy(array.dtype)
        value.shape = ir.Shape(array.shape)
        self.graph.register_initializer(value)
        return value

    # --- embeddings -------------------------------------------------------------------------------

    def embeddings(self) -> int:
        """Gather(tokens, ids) + Slice(positions, 0, T) + constant rows, LayerNormalization -> EmbedLayerNormalization.

        The constant rows (token type 0 of a BERT checkpoint) are added into the position table, which the
        fused kernel indexes by position 0..T-1 as the Slice did.
        """
        fused = 0
        for ln in list(self.graph):
            if ln.op_type != "LayerNormalization" or ln.domain not in ("", "ai.onnx"):
                continue
            match = self._match_embeddings(ln)
            if match is None:
                continue
            tokens, positions, gamma, beta = match
            name = f"EmbedLayerNormalization_{fused}"
            ids = self._int32(INPUT_NAMES[0], before=ln)
            node = ir.Node(
                MS,
                "EmbedLayerNormalization",
                # input_ids, segment_ids, word, position, segment embeddings, gamma, beta
                [ids, None, tokens, self._initializer(f"{name}.positions", positions), None, gamma, beta],
                [ir.AttrFloat32("epsilon", ln.attributes.get_float("epsilon", 1e-5))],
                name=name,
                num_outputs=2,
            )
            out, mask_index = node.outputs
            old = ln.outputs[0]
            out.name, out.type, out.shape = f"{name}_output", old.type, old.shape
            mask_index.name, mask_index.dtype = f"{name}_mask_index", ir.DataType.INT32
            self.graph.insert_before(ln, node)
            old.replace_all_uses_with(out)
            fused += 1
        return fused

    def _match_embeddings(
        self, ln: ir.Node
    ) -> tuple[ir.Value, npt.NDArray[np.generic], ir.Value, ir.Value | None] | None:
        axis = ln.attributes.get_int("axis", -1)
        x = ln.inputs[0]
        if axis not in (-1, 2) or x is None or x.shape is None or len(x.shape) != 3:
            return None
        if any(o.uses() for o in ln.outputs[1:]):
            return None
        gamma = ln.inputs[1]
        beta = ln.inputs[2] if len(ln.inputs) > 2 else None
        if _np(gamma) is None or (beta is not None and _np(beta) is None):
            return None
        terms = self._add_terms(x)
        gathers = [n for t in terms if (n := _is(t, "Gather")) is not None]
        slices = [n for t in terms if (n := _is(t, "Slice")) is not None]
        constants = [c for t in terms if (c := _np(t)) is not None]
        if len(gathers) != 1 or len(slices) != 1 or len(constants) != len(terms) - 2:
            return None
        gather, slice_ = gathers[0], slices[0]
        tokens = gather.inputs[0]
        table = _np(tokens)
        if table is None or table.ndim != 2 or gather.attributes.get_int("axis", 0) != 0:
            return None
        if not _input(gather.inputs[1], INPUT_NAMES[0]):
            return None
        positions = self._position_table(slice_)
        if positions is None or positions.shape[1] != table.shape[1]:
            return None
        d = table.shape[1]
        for c in constants:
            if c.size != d or c.shape[-1] != d:
                return None
            positions = positions + c.reshape(d).astype(positions.dtype)
        return tokens, positions, gamma, beta  # type: ignore[return-value]

    def _add_terms(self, value: ir.Value, top: bool = True) -> list[ir.Value]:
        """The leaves of a tree of Adds whose inner sums are used only inside the tree."""
        node = _is(value, "Add")
        if node is None or (not top and len(value.uses()) != 1):
            return [value]
        return [t for v in node.inputs if v is not None for t in self._add_terms(v, top=False)]

    def _position_table(self, slice_: ir.Node) -> npt.NDArray[np.generic] | None:
        """The position table if `slice_` takes its first T rows, T being the inputs' sequence length."""
        data, starts, ends, *rest = [*slice_.inputs, None, None][:5]
        axes, steps = rest
        table = _np(data)
        if table is None or table.ndim != 2 or not _same(_np(starts), [0]):
            return None
        if axes is not None and not _same(_np(axes), [0]):
            return None
        if steps is not None and not _same(_np(steps), [1]):
            return None
        shape = _is(ends, "Shape")
        if shape is None or not any(_input(shape.inputs[0], n) for n in INPUT_NAMES):
            return None
        if (shape.attributes.get_int("start", 0), shape.attributes.get_int("end", 0)) != (1, 2):
            return None
        return table

    # --- attention --------------------------------------------------------------------------------

    def attention(self) -> int:
        """MultiHeadAttention over three projections of one input -> Attention with packed QKV weights.

        The additive padding bias `(1 - mask) * fill` becomes the raw attention_mask (int32) with
        `mask_filter_value=fill`: the kernel adds the same `fill` to the same scores.
        """
        fused = 0
        for mha in list(self.graph):
            if mha.op_type != "MultiHeadAttention" or mha.domain != MS:
                continue
            ins = [*mha.inputs, *([None] * 8)][:8]
            query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value = ins
            if any(v is not None for v in (bias, key_padding_mask, past_key, past_value)):
                continue
            if len(mha.outputs) > 1 and any(o.uses() for o in mha.outputs[1:]):
                continue
            if mha.attributes.get_int("unidirectional", 0):
                continue
            projections = [self._projection(v) for v in (query, key, value)]
            if any(p is None for p in projections):
                continue
            xs = {id(p[0]) for p in projections if p is not None}
            weights = [p[1] for p in projections if p is not None]
            biases = [p[2] for p in projections if p is not None]
            if len(xs) != 1 or len({w.shape[0] for w in weights}) != 1:
                continue
            x = projections[0][0]  # type: ignore[index]
            name = f"Attention_{fused}"
            attrs: list[ir.Attr] = [ir.AttrInt64("num_heads", mha.attributes.get_int("num_heads", 0))]
            if "scale" in mha.attributes:
                attrs.append(ir.AttrFloat32("scale", mha.attributes.get_float("scale")))
            sizes = [w.shape[1] for w in weights]
            if len(set(sizes)) > 1:
                attrs.append(ir.AttrInt64s("qkv_hidden_sizes", sizes))
            mask_index: ir.Value | None = None
            padding = self._padding_mask(attention_bias)
            if padding is not None:
                mask_name, fill = padding
                mask_index, attention_bias = self._int32(mask_name, before=mha), None
                attrs.append(ir.AttrFloat32("mask_filter_value", fill))
            elif "mask_filter_value" in mha.attributes:
                continue
            node = ir.Node(
                MS,
                "Attention",
                [
                    x,
                    self._initializer(f"{name}.qkv_weight", np.concatenate(weights, axis=1)),
                    self._initializer(f"{name}.qkv_bias", np.concatenate(biases)),
                    mask_index,
                    None,  # past
                    attention_bias,
                ],
                attrs,
                name=name,
                num_outputs=1,
            )
            old = mha.outputs[0]
            out = node.outputs[0]
            out.name, out.type, out.shape = f"{name}_output", old.type, old.shape
            self.graph.insert_before(mha, node)
            old.replace_all_uses_with(out)
            fused += 1
        return fused

    @staticmethod
    def _projection(
        value: ir.Value | None,
    ) -> tuple[ir.Value, npt.NDArray[np.generic], npt.NDArray[np.generic]] | None:
        """(x, W, b) if `value` is x @ W + b (or x @ W) with constant W (d_in, d_out) and b (d_out)."""
        bias: npt.NDArray[np.generic] | None = None
        add = _is(value, "Add")
        if add is not None:
            a, b = add.inputs[0], add.inputs[1]
            if (bias := _np(b)) is not None:
                value = a
            elif (bias := _np(a)) is not None:
                value = b
            else:
                return None
        matmul = _is(value, "MatMul")
        if matmul is None or value is None or len(value.uses()) != 1:
            return None
        x, w = matmul.inputs[0], matmul.inputs[1]
        weight = _np(w)
        if x is None or weight is None or weight.ndim != 2:
            return None
        if bias is None:
            bias = np.zeros(weight.shape[1], dtype=weight.dtype)
        if bias.size != weight.shape[1]:
            return None
        return x, weight, bias.reshape(-1).astype(weight.dtype)

    @staticmethod
    def _padding_mask(bias: ir.Value | None) -> tuple[str, float] | None:
        """(mask input name, fill) if `bias` is `(1 - float(attention_mask[:, None, None, :])) * fill`, broadcast."""
        if (expand := _is(bias, "Expand")) is not None:
            bias = expand.inputs[0]
        mul = _is(bias, "Mul")
        if mul is None:
            return None
        fill: float | None = None
        sub = None
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            c = _np(b)
            if c is not None and c.size == 1 and (s := _is(a, "Sub")) is not None:
                fill, sub = float(c.reshape(-1)[0]), s
        if sub is None or fill is None or fill >= 0 or not _same(_np(sub.inputs[0]), [1.0]):
            return None
        cast = _is(sub.inputs[1], "Cast")
        if cast is None or cast.attributes.get_int("to", 0) != ir.DataType.FLOAT:
            return None
        unsqueeze = _is(cast.inputs[0], "Unsqueeze")
        if unsqueeze is None or not _same(_np(unsqueeze.inputs[1]), [1, 2]):
            return None
        mask = unsqueeze.inputs[0]
        if not _input(mask, INPUT_NAMES[1]) or mask is None or mask.name is None:
            return None
        return mask.name, fill
