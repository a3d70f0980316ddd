"""`mhaserve import`: an ONNX encoder made elsewhere, published as a version of a repository model.

What the Hub's `onnx/model.onnx` files and optimum's exports hold is a BERT-style encoder with inputs
input_ids, attention_mask (and usually token_type_ids) and an output `last_hidden_state` of token
states. The server's contract is narrower: exactly input_ids and attention_mask in, one pooled
`embeddings` (batch, hidden) out. The import closes the gap in the graph itself: token_type_ids
becomes a zero tensor the shape of input_ids (what a single-segment encoder feeds anyway), mean or
CLS pooling is appended after the chosen output, and the outputs the server does not read are dropped.
With `pool_in_graph` off, the token states are served as they are and the server pools them.

The result passes the same checks as an export before it is published by the same atomic rename:
names, dtypes and symbolic dimensions, the sha256 in the manifest, a run at the longest length, and
either the parity gate against the eager model built from a reference checkpoint (`--reference`) or,
without one, the padding check (a row alone and padded inside a batch embed the same).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import onnx
from onnx import TensorProto, helper
from tokenizers import Tokenizer

from mhaserve.export import staging
from mhaserve.runtime import manifest as mf
from mhaserve.runtime import tokenizer as serving_tokenizer
from mhaserve.runtime.errors import reason
from mhaserve.runtime.progress import Progress

TOKEN_TYPES = "token_type_ids"
DEFAULT_OUTPUT = "last_hidden_state"


class ImportFailed(RuntimeError):
    """The graph cannot be imported; the message is the one line the user sees."""


@dataclass(frozen=True)
class ImportOptions:
    """What `mhaserve import` was asked to do; None means "read it from the files beside the tokenizer"."""

    onnx: Path
    tokenizer: Path
    name: str
    repository: Path = Path("models")
    version: int | None = None
    output: str = DEFAULT_OUTPUT
    pooling: str | None = None
    normalize: bool | None = None
    max_seq_len: int | None = None
    reference: Path | None = None
    pool_in_graph: bool = True
    overwrite: bool = False


@dataclass(frozen=True)
class SentenceConfig:
    """What sentence-transformers keeps beside a model's tokenizer: length limit, pooling, normalisation."""

    max_seq_len: int | None
    pooling: str
    normalize: bool


def _dims(vi: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value or "?" for d in vi.type.tensor_type.shape.dim]


# What a graph's input or output is, when it is not a tensor (TypeProto's `value`).
_KINDS = {
    "sequence_type": "a sequence",
    "map_type": "a map",
    "optional_type": "an optional",
    "sparse_tensor_type": "a sparse tensor",
    "opaque_type": "an opaque value",
}


def _tensor_type(vi: onnx.ValueInfoProto, what: str, wanted: str) -> int:
    """The element type of the tensor `vi`, refusing anything else: a sequence, a map, or a tensor whose dtype
    the graph leaves undeclared (elem_type 0), which has no numpy dtype to name (a KeyError traceback once).
    `what` names it ("graph input input_ids"), `wanted` says what the server needs of it."""
    kind = vi.type.WhichOneof("value")
    if kind is None:
        raise ImportFailed(f"{what} has no type; {wanted}")
    if kind != "tensor_type":
        raise ImportFailed(f"{what} is {_KINDS.get(kind, kind)}, not a tensor; {wanted}")
    if vi.type.tensor_type.elem_type == TensorProto.UNDEFINED:
        raise ImportFailed(f"{what} has no dtype (elem_type 0); {wanted}")
    return vi.type.tensor_type.elem_type


def _dtype_name(elem_type: int) -> str:
    try:
        return str(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)))
    except (KeyError, TypeError):  # a type numpy lacks, or a number onnx does not know
        return TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else str(elem_type)


def _graph_inputs(graph: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    # Graphs of IR version < 4 list their initializers among the inputs as well.
    weights = {i.name for i in graph.initializer}
    return {i.name: i for i in graph.input if i.name not in weights}


def adapt_inputs(graph: onnx.GraphProto) -> bool:
    """Leave exactly input_ids and attention_mask as inputs; True if token_type_ids was folded to zeros."""
    inputs = _graph_inputs(graph)
    missing = [n for n in mf.INPUT_NAMES if n not in inputs]
    extra = [n for n in inputs if n not in (*mf.INPUT_NAMES, TOKEN_TYPES)]
    if missing or extra:
        raise ImportFailed(
            f"graph inputs are {list(inputs)}; an encoder needs input_ids and attention_mask"
            + (f" (missing {missing})" if missing else "")
            + (f", and only token_type_ids besides them (unsupported: {extra})" if extra else "")
        )
    for name in mf.INPUT_NAMES:
        vi = inputs[name]
        elem_type = _tensor_type(vi, f"graph input {name}", "the server feeds int64 tensors (batch, sequence)")
        if elem_type != TensorProto.INT64:
            raise ImportFailed(
                f"graph input {name} is {_dtype_name(elem_type)}; the server feeds int64 (export the graph with "
                "int64 ids)"
            )
        dims = _dims(vi)
        # A number here means the exporter froze that dimension: the graph would refuse other sizes.
        if len(dims) != 2 or any(isinstance(d, int) for d in dims):
            raise ImportFailed(f"graph input {name} has dims {dims}; both must be symbolic (batch, sequence)")
    if TOKEN_TYPES not in inputs:
        return False
    # the zeros are made in its declared dtype: there must be one
    dtype = _tensor_type(inputs[TOKEN_TYPES], f"graph input {TOKEN_TYPES}", "it is folded to zeros of its dtype")
    graph.input.remove(inputs[TOKEN_TYPES])
    zeros = [
        helper.make_node("Shape", ["input_ids"], ["mhaserve_import/ids_shape"]),
        helper.make_node(
            "ConstantOfShape",
            ["mhaserve_import/ids_shape"],
            [TOKEN_TYPES],
            value=helper.make_tensor("zero", dtype, [1], [0]),
        ),
    ]
    # Nodes are kept in topological order: the zeros come before any node that reads them.
    for node in reversed(zeros):
        graph.node.insert(0, node)
    return True


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def pooling_nodes(states: str, pooling: str, opset: int) -> list[onnx.NodeProto]:
    """Nodes from token states (B, T, d) and attention_mask to `embeddings` (B, d), as mhaserve.model pools.

    Mean: the sum over real tokens divided by their count, clamped at 1e-9 as sentence-transformers does
    (an all-padding row gives zeros, not NaN). CLS: the first token's state.
    """
    p = "mhaserve_import/"
    if pooling == "cls":
        return [
            helper.make_node(
                "Constant", [], [p + "first"], value=helper.make_tensor("first", TensorProto.INT64, [], [0])
            ),
            helper.make_node("Gather", [states, p + "first"], [mf.OUTPUT_NAME], axis=1),
        ]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    last = helper.make_tensor("last", TensorProto.INT64, [1], [2])
    # From opset 13 Unsqueeze and ReduceSum take their axes as an input, before it as an attribute.
    if opset >= 13:
        unsqueeze = [
            helper.make_node("Constant", [], [p + "last"], value=last),
            helper.make_node("Unsqueeze", [p + "mask_f", p + "last"], [p + "mask3"]),
        ]
        reduce_axes = [helper.make_node("Constant", [], [p + "axes"], value=axes)]

        def reduce(x: str, out: str) -> onnx.NodeProto:
            return helper.make_node("ReduceSum", [x, p + "axes"], [out], keepdims=0)
    else:
        unsqueeze = [helper.make_node("Unsqueeze", [p + "mask_f"], [p + "mask3"], axes=[2])]
        reduce_axes = []

        def reduce(x: str, out: str) -> onnx.NodeProto:
            return helper.make_node("ReduceSum", [x], [out], axes=[1], keepdims=0)

    return [
        helper.make_node("Cast", ["attention_mask"], [p + "mask_f"], to=TensorProto.FLOAT),
        *unsqueeze,
        *reduce_axes,
        helper.make_node("Mul", [states, p + "mask3"], [p + "masked"]),
        reduce(p + "masked", p + "summed"),
        reduce(p + "mask3", p + "count"),
        helper.make_node("Constant", [], [p + "tiny"], value=helper.make_tensor("tiny", TensorProto.FLOAT, [], [1e-9])),
        helper.make_node("Max", [p + "count", p + "tiny"], [p + "count_min"]),
        helper.make_node("Div", [p + "summed", p + "count_min"], [mf.OUTPUT_NAME]),
    ]


def _prune(graph: onnx.GraphProto) -> None:
    """Drop the nodes and weights no output needs (a Hub graph's pooler, once its output is gone)."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
            # names a subgraph (If, Loop) reads from the outer scope
            for attr in node.attribute:
                for sub in [attr.g, *attr.graphs]:
                    needed.update(i for n in sub.node for i in n.input)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    weights = [w for w in graph.initializer if w.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(weights)


def _names(graph: onnx.GraphProto) -> set[str]:
    """Every value the graph and its subgraphs (If, Loop) name."""
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    names.update(w.name for w in graph.initializer)
    names.update(w.values.name for w in graph.sparse_initializer)
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for attr in node.attribute:
            for sub in [attr.g, *attr.graphs]:
                names |= _names(sub)
    names.discard("")  # an optional input left out
    return names


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Call the value `old` `new` wherever the graph and its subgraphs name it."""
    for v in (*graph.input, *graph.output, *graph.value_info):
        if v.name == old:
            v.name = new
    for t in graph.initializer:
        if t.name == old:
            t.name = new
    for w in graph.sparse_initializer:
        if w.values.name == old:
            w.values.name = new
    for node in graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
        for attr in node.attribute:
            for sub in [attr.g, *attr.graphs]:
                _rename(sub, old, new)


def adapt_outputs(graph: onnx.GraphProto, output: str, pooling: str, opset: int, pool_in_graph: bool) -> None:
    """Keep only the token states (pooled into `embeddings` when `pool_in_graph`)."""
    outputs = {o.name: o for o in graph.output}
    if output not in outputs:
        raise ImportFailed(f"graph has no output {output!r} (its outputs: {list(outputs)}); name one with --output")
    states = outputs[output]
    elem_type = _tensor_type(states, f"output {output}", "token states are a float32 tensor (batch, sequence, hidden)")
    if elem_type != TensorProto.FLOAT:
        raise ImportFailed(
            f"output {output} is {_dtype_name(elem_type)}; import a float32 graph (fp16 variants come from it)"
        )
    dims = _dims(states)
    if len(dims) != 3:
        raise ImportFailed(f"output {output} has dims {dims}; token states are (batch, sequence, hidden)")
    hidden = dims[2]
    del graph.output[:]
    if not pool_in_graph:
        graph.output.append(states)
        return
    names = _names(graph)
    if mf.OUTPUT_NAME in names:
        # The graph has a value of that name already (token states exported as `embeddings`, say): the pooled
        # output would be a second one, and ONNX refuses a graph that is not in SSA form. Theirs is renamed.
        free = "mhaserve_import/graph_" + mf.OUTPUT_NAME
        n = 1
        while free in names:
            free, n = f"mhaserve_import/graph_{mf.OUTPUT_NAME}_{n}", n + 1
        _rename(graph, mf.OUTPUT_NAME, free)
        if output == mf.OUTPUT_NAME:
            output = free
    graph.node.extend(pooling_nodes(output, pooling, opset))
    graph.output.append(
        helper.make_tensor_value_info(
            mf.OUTPUT_NAME, TensorProto.FLOAT, ["batch", hidden if isinstance(hidden, int) else "hidden"]
        )
    )


def _constant_ints(graph: onnx.GraphProto, name: str) -> list[int] | None:
    """The value of an initializer or Constant node, if `name` is one."""
    from onnx import numpy_helper

    for w in graph.initializer:
        if w.name == name:
            return [int(v) for v in numpy_helper.to_array(w).ravel()]
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            return None if value is None else [int(v) for v in numpy_helper.to_array(value).ravel()]
    return None


def embedding_tables(graph: onnx.GraphProto) -> list[tuple[str, int]]:
    """(name, rows) of the weights read by row: token, position and token-type tables.

    A table is read by a Gather on axis 0 (the TorchScript exporter, and the token table of both), by a
    Slice of its first rows (torch.export, for positions 0..T-1), or is an input of ORT's fused
    EmbedLayerNormalization.
    """
    shapes = {w.name: list(w.dims) for w in graph.initializer}
    tables = {}
    for node in graph.node:
        data = node.input[0] if node.input else ""
        if len(shapes.get(data, [])) != 2:
            continue
        if node.op_type == "Gather" and next((a.i for a in node.attribute if a.name == "axis"), 0) == 0:
            tables[data] = shapes[data][0]
        elif node.op_type == "Slice":
            axes = _constant_ints(graph, node.input[3]) if len(node.input) > 3 and node.input[3] else [0]
            if axes == [0]:
                tables[data] = shapes[data][0]
    for node in graph.node:
        if node.op_type == "EmbedLayerNormalization":  # word, position and segment tables
            tables.update({n: shapes[n][0] for n in node.input[2:5] if n in shapes})
    return list(tables.items())


def position_rows(graph: onnx.GraphProto, vocab_size: int) -> int | None:
    """The rows of the position table, if the graph has exactly one table that can be it.

    The token table has at least the tokenizer's vocabulary, a token-type table a handful of rows; what
    is left is the position table, whose size is the longest sequence the graph can take.
    """
    rows = [r for _, r in embedding_tables(graph) if 16 < r < vocab_size]
    return rows[0] if len(rows) == 1 else None


def read_sentence_config(directory: Path, max_positions: int | None) -> SentenceConfig:
    """sentence-transformers' files beside the tokenizer (as a Hub model repository has them), if any."""
    from mhaserve.model.checkpoint import CheckpointError, sentence_settings

    try:
        max_seq_len, pooling, normalize = sentence_settings(directory, max_positions)
    except CheckpointError as e:
        raise ImportFailed(
            f"{e} (or give --pooling, --normalize or --no-normalize, and --max-seq-len: then they are not read)"
        ) from None
    return SentenceConfig(max_seq_len, pooling, normalize)


def read_prompts(directory: Path) -> tuple[dict[str, str], str]:
    """sentence-transformers' named prompts and default prompt beside the tokenizer, if any."""
    from mhaserve.model.checkpoint import CheckpointError, sentence_prompts

    try:
        return sentence_prompts(directory)
    except CheckpointError as e:
        raise ImportFailed(str(e)) from None


# Texts whose ids tell tokenizers apart: case, accents, punctuation, digits, scripts, a long word.
_PROBES = ("The Quick Brown Fox, 1984!", "Café déjà vu — naïve façade", "HELLO world: e-mail@example.com",
           "中文 Ελληνικά русский", "antidisestablishmentarianism's")  # fmt: skip


def _check_same_tokenizer(ours: Tokenizer, reference: Tokenizer, path: Path) -> None:
    ours, reference = (Tokenizer.from_str(t.to_str()) for t in (ours, reference))
    for t in (ours, reference):  # MiniLM's own file pads to 128: compare the tokens, not the padding
        t.no_padding()
        t.no_truncation()
    for text in _PROBES:
        a, b = ours.encode(text).ids, reference.encode(text).ids
        if a != b:
            raise ImportFailed(
                f"{path} does not tokenise as the reference's tokenizer.json: {text!r} gives {a[:12]} against "
                f"{b[:12]}; pass the tokenizer the graph was made with"
            )


def _runs_at(graph: Path, length: int, vocab_size: int, pooling: str, pad_id: int) -> bool:
    from mhaserve.runtime.engine import OnnxEngine

    if length < 2:
        return False
    ids = np.full((1, length), (pad_id + 1) % vocab_size, dtype=np.int64)
    try:
        engine = OnnxEngine(graph, max_seq_len=length, vocab_size=vocab_size, device="cpu", pooling=pooling)
        engine.run(ids, np.ones_like(ids))
    except Exception:
        return False
    return True


def _load_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ImportFailed(f"{path} is not a tokenizers JSON file: {e}") from None


def _pad_id(tok: Tokenizer) -> int:
    """The id the tokenizer pads with: padded positions are masked, but the id must be in the vocabulary."""
    if tok.padding is not None:
        return int(tok.padding["pad_id"])
    for token in ("[PAD]", "<pad>"):
        if (i := tok.token_to_id(token)) is not None:
            return int(i)
    return 0


def import_entry(opts: ImportOptions, out: TextIO | None = None) -> Path:
    """Adapt, check, gate and publish the graph; return the published entry's directory."""
    from mhaserve.export import parity
    from mhaserve.runtime.engine import OnnxEngine

    name = mf.check_name(opts.name)
    if not opts.onnx.is_file():
        raise ImportFailed(f"{opts.onnx} is not a file")
    if not opts.tokenizer.is_file():
        raise ImportFailed(f"{opts.tokenizer} is not a file (a tokenizers JSON file, as tokenizer.json)")
    with staging.reserved(opts.repository, name, opts.version, opts.overwrite) as (version_, target, scratch):
        progress = Progress(5, out)
        with progress.step(f"reading {opts.onnx}"):
            try:
                # The binary format whatever the name: onnx reads a .json file as JSON protobuf, whose errors
                # list the message's fields over several lines.
                model = onnx.load(str(opts.onnx), format="protobuf")
            except Exception as e:  # onnx raises DecodeError, OSError, ValueError, ...
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ImportFailed(f"{opts.onnx} is not an ONNX model: {first}") from None
            tokenizer = _load_tokenizer(opts.tokenizer)
            pad_id = _pad_id(tokenizer)  # before for_serving turns its padding off
            vocab_size = tokenizer.get_vocab_size()
            tables = embedding_tables(model.graph)
            graph_vocab = max((r for _, r in tables), default=vocab_size)
            if vocab_size > graph_vocab:
                raise ImportFailed(
                    f"the tokenizer has {vocab_size} tokens but the graph's largest table has {graph_vocab} rows"
                )
            positions = position_rows(model.graph, vocab_size)
            prompts, default_prompt = read_prompts(opts.tokenizer.parent)
            if opts.pooling is not None and opts.normalize is not None and opts.max_seq_len is not None:
                sentence = SentenceConfig(opts.max_seq_len, opts.pooling, opts.normalize)  # all given: none read
            else:
                sentence = read_sentence_config(opts.tokenizer.parent, positions)
            max_seq_len = opts.max_seq_len or sentence.max_seq_len or positions
            if max_seq_len is None:
                raise ImportFailed(
                    "cannot tell the graph's longest sequence (no single position table): pass --max-seq-len"
                )
            if positions is not None and max_seq_len > positions:
                raise ImportFailed(f"--max-seq-len {max_seq_len} is past the graph's {positions} positions")
            pooling = opts.pooling or sentence.pooling
            normalize = sentence.normalize if opts.normalize is None else opts.normalize

        with progress.step(
            "adapting inputs and outputs" + (f", {pooling} pooling in the graph" if opts.pool_in_graph else "")
        ):
            folded = adapt_inputs(model.graph)
            adapt_outputs(model.graph, opts.output, pooling, _opset(model), opts.pool_in_graph)
            _prune(model.graph)
            graph = scratch / "model.onnx"
            big = model.ByteSize() > staging.EXTERNAL_DATA_BYTES
            onnx.save(model, str(graph), save_as_external_data=big, location="model.onnx.data" if big else None)
            try:
                onnx.checker.check_model(str(graph))
            except onnx.checker.ValidationError as e:
                raise ImportFailed(f"the adapted graph is not valid ONNX: {e}") from None
            staging.save_tokenizer(serving_tokenizer.for_serving(tokenizer, max_seq_len), scratch / mf.TOKENIZER)

        with progress.step(f"loading in ONNX Runtime, a run at {max_seq_len} tokens"):
            # Ids that are not the pad id: a graph that numbers positions from its non-pad tokens (RoBERTa,
            # from padding_idx + 1) reads its position table only for those; all-pad ids never reached its end.
            ids = np.full((2, max_seq_len), (pad_id + 1) % vocab_size, dtype=np.int64)
            try:
                engine = OnnxEngine(
                    graph, max_seq_len=max_seq_len, vocab_size=vocab_size, device="cpu", pooling=pooling
                )
                hidden = int(engine.run(ids, np.ones_like(ids)).shape[1])
            except Exception as e:  # ORT's own errors (InvalidGraph, Fail, RuntimeException) say what is wrong
                offset = max_seq_len == positions and not (opts.max_seq_len or sentence.max_seq_len)
                if not offset or not _runs_at(graph, max_seq_len - 2, vocab_size, pooling, pad_id):
                    raise ImportFailed(
                        f"ONNX Runtime cannot run the adapted graph at {max_seq_len} tokens: {e}"
                    ) from None
                # Its position table has 2 rows before the first position (RoBERTa's padding_idx + 1): serve
                # the positions it has, as sentence-transformers does.
                max_seq_len -= 2
                staging.save_tokenizer(serving_tokenizer.for_serving(tokenizer, max_seq_len), scratch / mf.TOKENIZER)
                engine = OnnxEngine(
                    graph, max_seq_len=max_seq_len, vocab_size=vocab_size, device="cpu", pooling=pooling
                )
                hidden = int(engine.run(ids[:, :max_seq_len], np.ones_like(ids[:, :max_seq_len])).shape[1])

        if opts.reference is not None:
            with progress.step(f"parity gate vs the eager model from {opts.reference}", reports=True):
                from mhaserve.model.checkpoint import CheckpointError, load_encoder

                try:
                    eager, reference = load_encoder(opts.reference)
                except (CheckpointError, ValueError) as e:
                    raise ImportFailed(str(e)) from None
                # The gate feeds ids, never text: a tokenizer that is not the reference's (a cased variant of
                # the same vocabulary) passed it and served capitals as [UNK].
                _check_same_tokenizer(tokenizer, _load_tokenizer(reference.tokenizer_path), opts.tokenizer)
                if eager.cfg.d_model != hidden:
                    raise ImportFailed(f"the reference has hidden size {eager.cfg.d_model}, the graph {hidden}")
                if eager.cfg.pooling != pooling:
                    raise ImportFailed(f"the reference pools by {eager.cfg.pooling}, the import by {pooling}")
                try:
                    report = parity.gate(eager, engine, variant="imported").to_dict()
                except parity.ParityError as e:
                    raise ImportFailed(f"{e}; nothing was published") from None
                except Exception as e:  # the reference's lengths or ids past the import's (InvalidArgument, ORT)
                    raise ImportFailed(
                        f"the parity gate cannot run the graph on the reference's inputs: {reason(e)} (is the "
                        "reference the model this graph was made from, with its tokenizer and --max-seq-len?)"
                    ) from None
                sizes = (eager.cfg.n_layers, eager.cfg.n_heads, eager.cfg.d_ff)
        else:
            with progress.step("padding check (no --reference: a row alone and padded in a batch embed the same)"):
                try:
                    diff = parity.padding_diff(engine, max_seq_len=max_seq_len, vocab_size=vocab_size, pad_id=pad_id)
                except Exception as e:  # ORT's error: the graph's tables are smaller than the tokenizer says
                    raise ImportFailed(f"the padding check cannot run the graph: {str(e).strip()[:300]}") from None
                if diff > parity.FP32_TOLERANCE:
                    raise ImportFailed(
                        f"padding changes the embeddings by up to {diff:.3g} (tolerance {parity.FP32_TOLERANCE:g}): "
                        "the graph does not honour attention_mask; nothing was published"
                    )
                report = {
                    "reference": None,
                    "padding_max_abs_diff": diff,
                    "tolerance": parity.FP32_TOLERANCE,
                    "passed": True,
                }
                sizes = (0, 0, 0)  # not known without a reference: the manifest says 0

        with progress.step(f"publishing {target}"):
            layers, heads, ffn = sizes
            states_shape = ["batch", "sequence", hidden]
            manifest = mf.Manifest(
                name=name,
                version=version_,
                source=f"imported from {opts.onnx.resolve()} (sha256 {mf.sha256_file(opts.onnx)})",
                architecture="imported",
                hidden_size=hidden,
                layers=layers,
                heads=heads,
                ffn=ffn,
                max_seq_len=max_seq_len,
                max_positions=positions or max_seq_len,
                pooling=pooling,
                normalize=normalize,
                vocab_size=vocab_size,
                pad_id=pad_id,
                opset=_opset(model),
                graphs={
                    "fp32": mf.GraphEntry.of(
                        graph,
                        precision="fp32",
                        optimized=False,
                        parity=report | {"token_type_ids": "zeros" if folded else "absent"},
                    )
                },
                inputs=[{"name": n, "dtype": "int64", "shape": ["batch", "sequence"]} for n in mf.INPUT_NAMES],
                outputs=[
                    {"name": mf.OUTPUT_NAME, "dtype": "float32", "shape": ["batch", hidden]}
                    if opts.pool_in_graph
                    else {"name": opts.output, "dtype": "float32", "shape": states_shape}
                ],
                tokenizer_sha256=mf.sha256_file(scratch / mf.TOKENIZER),
                exporter=staging.tool_versions() | {"import": "mhaserve import"},
                created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                prompts=prompts,
                default_prompt_name=default_prompt,
            )
            (scratch / mf.MANIFEST).write_text(manifest.to_json())
            # --overwrite replaces the version named by --version, never the next free one that another
            # (a copy, an older mhaserve) published meanwhile
            staging.publish(scratch, target, overwrite=opts.overwrite and opts.version is not None)
    return target
