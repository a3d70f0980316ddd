"""In-process speed of an entry's graphs against one another: the graph tables of docs/benchmarks.md.

The measurement is `export/speed.py`'s (interleaved, so that a burst of load on a shared machine falls
on all graphs alike; ratios to the first graph, median and range over rounds), over the bench's texts.

Two clocks:
- `wall`: wall time with the engine's intra-op threads (the serving default: all cores), what a server gets;
- `cpu`: one intra-op thread, so that ONNX Runtime computes on the calling thread alone, and that thread's
  CPU time, which other processes on a shared machine barely disturb (they take turns on the core, not
  the work).

Workloads are the bench's texts (installed with mhaserve-loadtest), tokenised with the entry's tokenizer,
sorted by length and cut into batches (the least padding a batcher could reach):
- short: the short-text corpus (loadtest/texts/short.txt: queries, sentences, a tail of paragraphs);
- mixed: every text of the load-test corpus (queries to paragraphs, truncated at the model's maximum);
- fixed: the load-test corpus as one stream of tokens cut into inputs of exactly 128.

Run: python -m mhaserve.testing.graph_speed --repository models --graphs fp32 optimized int8 [--ort-reference]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mhaserve.export import onnx_graph, speed
from mhaserve.runtime import manifest as mf
from mhaserve.runtime.engine import Engine, OnnxEngine
from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving

FIXED_TOKENS = 128


@dataclass(frozen=True)
class Workload:
    name: str
    inputs: list[list[int]]

    def batches(self, size: int, pad_id: int) -> list[speed.Batch]:
        return speed.batches(self.inputs, size, pad_id)

    def summary(self) -> dict[str, Any]:
        lengths = sorted(len(r) for r in self.inputs)
        return {"inputs": len(lengths), "median_tokens": lengths[len(lengths) // 2], "max_tokens": lengths[-1]}


def _bench_texts(package: str, name: str) -> Path:
    # by name, not by import: the tooling sits above this harness and may not be installed
    try:
        from importlib import resources

        return Path(str(resources.files(package).joinpath(name)))
    except ModuleNotFoundError:
        raise SystemExit(f"no --corpus/--short given and mhaserve-loadtest ({name}) is not installed") from None


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def workloads(
    texts: list[str], short: list[str], encode: Callable[[list[str], bool], list[list[int]]]
) -> dict[str, Workload]:
    every = encode(texts, True)
    stream = [t for ids in encode(texts, False) for t in ids]
    wrapper = encode([""], True)[0]  # [CLS] [SEP]
    body = FIXED_TOKENS - len(wrapper)
    fixed = [wrapper[:1] + stream[k : k + body] + wrapper[1:] for k in range(0, len(stream) - body, body)]
    return {
        "short": Workload("short", encode(short, True)),
        "mixed": Workload("mixed", every),
        "fixed": Workload("fixed", fixed),
    }


def ort_reference(out: Path, num_heads: int, hidden: int) -> Path:
    """ONNX Runtime's transformer optimizer at its highest level (99) on a legacy (TorchScript) export of the
    Hugging Face BertModel of all-MiniLM-L6-v2 with mean pooling: the graph peers such as Infinity serve."""
    import torch
    from onnxruntime.transformers import optimizer
    from transformers import BertModel

    from mhaserve.model.checkpoint import default_source

    bert = BertModel.from_pretrained(str(default_source()), attn_implementation="eager").eval()

    class MeanPooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            x = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(x.dtype)
            return (x * m).sum(1) / m.sum(1).clamp(min=1e-9)

    legacy = out / "legacy.onnx"
    example = (torch.ones((2, 3), dtype=torch.long), torch.ones((2, 3), dtype=torch.long))
    dims = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(
            MeanPooled().eval(),
            example,
            str(legacy),
            dynamo=False,
            input_names=["input_ids", "attention_mask"],
            output_names=["embeddings"],
            dynamic_axes={"input_ids": dims, "attention_mask": dims, "embeddings": {0: "batch"}},
            opset_version=17,
        )
    fused = optimizer.optimize_model(
        str(legacy), model_type="bert", num_heads=num_heads, hidden_size=hidden, opt_level=99, use_gpu=False
    )
    path = out / "ort_optimizer.onnx"
    fused.save_model_to_file(str(path))
    print(f"ORT optimizer reference: {len(fused.model.graph.node)} nodes", file=sys.stderr)
    return path


def measure(
    graphs: dict[str, Path],
    work: list[speed.Batch],
    *,
    rounds: int,
    threads: int | None,
    cpu_clock: bool,
    max_seq_len: int,
    vocab_size: int,
) -> dict[str, dict[str, float]]:
    engines: dict[str, Engine] = {
        name: OnnxEngine(p, max_seq_len=max_seq_len, vocab_size=vocab_size, device="cpu", intra_op_threads=threads)
        for name, p in graphs.items()
    }
    return speed.interleaved(engines, work, rounds=rounds, cpu_clock=cpu_clock)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--repository", type=Path, default=Path("models"))
    p.add_argument("--model", default=None)
    p.add_argument(
        "--graphs",
        nargs="+",
        default=None,
        help="variants of the entry, or name=path.onnx (default: the entry's CPU graphs)",
    )
    p.add_argument("--ort-reference", action="store_true", help="add ORT's optimizer on a legacy export (MiniLM)")
    p.add_argument("--corpus", type=Path, default=None, help="texts of mixed and fixed (default: the bench's)")
    p.add_argument("--short", type=Path, default=None, help="texts of short (default: the bench's short.txt)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N texts of each file")
    p.add_argument("--workloads", nargs="+", default=["short", "mixed", "fixed"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    p.add_argument("--clocks", nargs="+", default=["cpu", "wall"], choices=["cpu", "wall"])
    p.add_argument("--threads", type=int, default=None, help="intra-op threads for the wall clock (default: all)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)

    repo = ModelRepository(args.repository)
    entry = repo.entry(args.model)
    m = entry.manifest
    graphs: dict[str, Path] = {}
    for g in args.graphs or [v for v in mf.CPU_GRAPHS if v in m.graphs]:  # a variant of the entry, or name=path.onnx
        name, _, path = g.partition("=")
        graphs[name] = Path(path) if path else repo.entry(entry.name, entry.version, graph=name).graph_path
    tokenizer = load_for_serving(entry.tokenizer_path, m.max_seq_len)

    def encode(texts: list[str], special: bool) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=special)]

    corpus = args.corpus or _bench_texts("mhaserve.loadtest", "corpus.txt")
    short = args.short or _bench_texts("mhaserve.loadtest.texts", "short.txt")
    loads = workloads(_lines(corpus)[: args.limit], _lines(short)[: args.limit], encode)
    report: dict[str, Any] = {
        "model": f"{entry.name} v{entry.version}",
        "corpus": str(corpus),
        "short": str(short),
        "results": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        if args.ort_reference:
            graphs["ort-optimizer"] = ort_reference(Path(tmp), m.heads, m.hidden_size)
        report["nodes"] = {name: onnx_graph.node_counts(path) for name, path in graphs.items()}
        for name, counts in report["nodes"].items():
            print(f"{name}: {sum(counts.values())} nodes {counts}")
        for name in args.workloads:
            w = loads[name]
            for size in args.batch_sizes:
                batches = w.batches(size, m.pad_id)
                for clock in args.clocks:
                    threads = 1 if clock == "cpu" else args.threads
                    figures = measure(
                        graphs,
                        batches,
                        rounds=args.rounds,
                        threads=threads,
                        cpu_clock=clock == "cpu",
                        max_seq_len=m.max_seq_len,
                        vocab_size=m.vocab_size,
                    )
                    report["results"].append(
                        {"workload": name, **w.summary(), "batch": size, "clock": clock, "graphs": figures}
                    )
                    print(f"{name} ({w.summary()}), batch {size}, {clock} clock:")
                    for g, f in figures.items():
                        print(
                            f"  {g:14} {f['seq_per_s']:8.1f} seq/s  x{f['speed']:.2f} "
                            f"(rounds {f['speed_min']:.2f}-{f['speed_max']:.2f})",
                            flush=True,
                        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
