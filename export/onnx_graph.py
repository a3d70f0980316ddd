"""Writing the encoder as an ONNX graph with symbolic batch and sequence dimensions, and its variants."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
import torch

from mhaserve.model.encoder import Encoder
from mhaserve.runtime import external_data
from mhaserve.runtime.manifest import INPUT_NAMES, OUTPUT_NAME

if TYPE_CHECKING:
    import onnx_ir as ir

# Past this the protobuf limit (2 GiB) forces weights into an external-data file beside the graph.
_EXTERNAL_DATA_BYTES = 1_500_000_000


class GraphError(RuntimeError):
    """The exported graph does not have the contract the server relies on."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The dynamo exporter logs every step and warns about optional packages; the CLI has its own display."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript", "onnx_ir")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_graph(model: Encoder, path: Path) -> None:
    """Export `model` to `path` with torch.export (the dynamo exporter).

    The example batch is 2 x 3: an example dimension of 1 is specialised by the tracer and frozen into
    the graph, so both dimensions get example sizes >= 2 and are declared dynamic.
    """
    cfg = model.cfg
    ids = torch.full((2, 3), 1, dtype=torch.long)
    mask = torch.ones((2, 3), dtype=torch.long)
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("sequence", min=1, max=cfg.max_positions)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with _quiet(), torch.no_grad():
        program = torch.onnx.export(
            model.eval(),
            (ids, mask),
            dynamo=True,
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
            verbose=False,
        )
        if program is None:
            raise GraphError("torch.onnx.export returned no program")
        _drop_stack_traces(program.model)
        program.save(str(path), external_data=n_bytes > _EXTERNAL_DATA_BYTES)
    check_graph(path, cfg.d_model)


def _drop_stack_traces(model: ir.Model) -> None:
    """Remove the Python stack trace the exporter records on every node.

    They hold absolute paths of the checkout that exported (and of its virtualenv): the published graph,
    and so its sha256, would differ between two checkouts of the same code and weights, and it would
    carry the build machine's paths. The node's module path (`namespace`) stays, for debugging.
    """
    nodes = itertools.chain(model.graph.all_nodes(), *(f.all_nodes() for f in model.functions.values()))
    for node in nodes:
        node.metadata_props.pop("pkg.torch.onnx.stack_trace", None)


def _dims(value_info: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def check_graph(path: Path, hidden: int) -> int:
    """Assert the saved graph's contract (names, dtypes, symbolic dims); return its opset."""
    g = onnx.load(str(path), load_external_data=False)
    inputs = {i.name: i for i in g.graph.input}
    if tuple(inputs) != INPUT_NAMES:
        raise GraphError(f"graph inputs are {list(inputs)}, expected {list(INPUT_NAMES)}")
    for name, vi in inputs.items():
        if vi.type.tensor_type.elem_type != onnx.TensorProto.INT64:
            raise GraphError(f"graph input {name} is not int64")
        dims = _dims(vi)
        # A dim_value (an int) here means the tracer froze the dimension: the graph would refuse other sizes.
        if len(dims) != 2 or not all(isinstance(d, str) and d for d in dims):
            raise GraphError(f"graph input {name} has dims {dims}; both must be symbolic")
    outputs = list(g.graph.output)
    if [o.name for o in outputs] != [OUTPUT_NAME]:
        raise GraphError(f"graph outputs are {[o.name for o in outputs]}, expected [{OUTPUT_NAME!r}]")
    out_dims = _dims(outputs[0])
    if outputs[0].type.tensor_type.elem_type != onnx.TensorProto.FLOAT or len(out_dims) != 2 or out_dims[1] != hidden:
        raise GraphError(f"graph output must be float32 [batch, {hidden}], got dims {out_dims}")
    return next(o.version for o in g.opset_import if o.domain in ("", "ai.onnx"))


def node_counts(path: Path) -> dict[str, int]:
    """How many nodes of each type the graph has (the manifest records them; fusion shows in them)."""
    g = onnx.load(str(path), load_external_data=False)
    return dict(sorted(collections.Counter(n.op_type for n in g.graph.node).items()))


def optimize(src: Path, dst: Path) -> dict[str, int]:
    """ONNX Runtime's fused operators for a dynamo graph: packed-QKV Attention, EmbedLayerNormalization,
    SkipLayerNormalization, BiasGelu.

    ORT's own BERT optimizer only recognises the legacy TorchScript exporter's patterns; onnxscript's
    `optimize_for_ort` fuses a dynamo graph up to MultiHeadAttention, and `fusions.fuse_encoder` takes it
    the rest of the way.
    """
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    from mhaserve.export.fusions import fuse_encoder

    with _quiet():
        model = ir.load(str(src))
        model, counts = optimize_for_ort(model)
        counts |= fuse_encoder(model)
        ir.save(model, str(dst))
    return {k: int(v) for k, v in counts.items() if v}


def to_fp16(src: Path, dst: Path) -> None:
    """Weights and compute in fp16, inputs and output kept int64 / float32 so the contract holds."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # Half of a graph past 4 GB is still past the protobuf's 2 GiB: a graph whose weights are beside it
    # writes its fp16 weights beside it too (model.fp16.onnx.data). Given the path, not the loaded model, the
    # converter infers shapes from the file (onnx's infer_shapes_path, in a temporary file beside it): on a model
    # loaded whole, past 2 GiB, its shape inference could not serialise the model (EncodeError).
    big = bool(external_data.locations(src))
    with _quiet():
        half = convert_float_to_float16(str(src), keep_io_types=True)
        onnx.save(half, str(dst), save_as_external_data=big, location=f"{dst.name}.data" if big else None)
