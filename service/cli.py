"""The `mhaserve` command: one entry point, one subcommand per job.

Nothing here runs at import; heavy imports (torch, onnxruntime) happen inside the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

Handler = Callable[[argparse.Namespace], int]


def _export(args: argparse.Namespace) -> int:
    from export.manifest import ManifestError
    from export.publish import ExportError, ExportOptions, export_entry

    random_config = {
        k: v
        for k, v in {
            "n_layers": args.layers,
            "d_model": args.d_model,
            "n_heads": args.heads,
            "d_ff": args.ffn,
            "max_positions": args.max_positions,
            "max_seq_len": args.max_seq_len,
            "vocab_size": args.vocab_size,
            "positional": args.positional,
            "pooling": args.pooling,
        }.items()
        if v is not None
    }
    if random_config and args.source != "random":
        print("mhaserve export: error: size options apply only to --source random", file=sys.stderr)
        return 2
    opts = ExportOptions(
        source=args.source,
        repository=Path(args.repository),
        name=args.name,
        version=args.version,
        optimize=args.optimize,
        fp16=args.fp16,
        overwrite=args.overwrite,
        random_config=random_config,
        seed=args.seed,
    )
    try:
        entry = export_entry(opts)
    except (ExportError, ManifestError) as e:
        print(f"mhaserve export: error: {e}", file=sys.stderr)
        return 1
    print(entry)
    return 0


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="export a model to ONNX, verify it against the eager model, publish it into a model repository",
        description="Export a model to ONNX with dynamic batch and sequence, run the parity gate, and publish "
        "models/<name>/<version>/ (model.onnx, tokenizer.json, manifest.json). Nothing is published if the gate fails.",
    )
    p.add_argument(
        "--source",
        default="minilm",
        help="'minilm' (all-MiniLM-L6-v2, offline, the default), 'random', or a local BERT checkpoint directory",
    )
    p.add_argument("--repository", default="models", help="model repository directory (default: models)")
    p.add_argument("--name", help="model name (default: all-minilm-l6-v2, the directory's name, or random-<seed>)")
    p.add_argument("--version", type=int, help="version number (default: the next free one)")
    p.add_argument("--optimize", action="store_true", help="also write a graph with ONNX Runtime fusions")
    p.add_argument("--fp16", action="store_true", help="also write an fp16 graph (for CUDA hosts)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing version")
    g = p.add_argument_group("random models (--source random)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--layers", type=int)
    g.add_argument("--d-model", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--ffn", type=int)
    g.add_argument("--max-positions", type=int)
    g.add_argument("--max-seq-len", type=int)
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--positional", choices=["learned", "sinusoidal"])
    g.add_argument("--pooling", choices=["mean", "cls"])
    p.set_defaults(handler=_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhaserve", description="Serve Transformer encoders over gRPC.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_export(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
