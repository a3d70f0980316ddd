"""The CPU's token budget on a wider, longer model than MiniLM: ONNX Runtime in process, one intra-op thread (a
worker's share of 2 cores), texts a second when batches are cut at each budget (padding included), inputs sorted
by length as the length policy sorts them; rounds alternate the budgets' order.

The model is any published one (a random BERT-base-wide export, for instance:
  mhaserve export --source random --repository /tmp/wide --name wide --version 1 --optimize \
      --layers 4 --d-model 768 --heads 12 --ffn 3072 --max-seq-len 512
); the inputs are the bench's short and mixed texts, tokenised by MiniLM's tokenizer with truncation at the
model's maximum, plus fixed inputs of 128 and of the maximum tokens. Run from the repository root:
  python docs/bench/2026-11-28-twentyfirst/budget_wide.py REPOSITORY NAME ROUNDS SECONDS BUDGET...
"""

import statistics
import sys
from pathlib import Path

import onnxruntime as ort

from mhaserve.loadtest.bench.workloads import build
from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "2026-11-28-twentieth"))
from budget_in_process import batches, rate  # noqa: E402


def main(repository: str, name: str, rounds: int, seconds: float, budgets: list[int]) -> None:
    entry = ModelRepository(Path(repository)).entry(name, graph="optimized")
    longest = entry.manifest.max_seq_len
    minilm = ModelRepository(Path("models")).entry("all-minilm-l6-v2")
    tokenizer = load_for_serving(minilm.tokenizer_path, longest)
    loads = build(["short", "mixed", "fixed"], tokenizer, max_seq_len=longest, fixed_tokens=128, fixed_pool=16,
                  mixed_pool=64, short_pool=200)  # fmt: skip
    inputs = {w: v.ids for w, v in loads.items()}
    inputs["fixed-max"] = build(["fixed"], tokenizer, max_seq_len=longest, fixed_tokens=longest, fixed_pool=8,
                                mixed_pool=1, short_pool=1)["fixed"].ids  # fmt: skip
    for w, ids in inputs.items():
        lengths = sorted(len(s) for s in ids)
        print(f"{w}: {len(ids)} inputs, median {lengths[len(ids) // 2]} tokens, max {lengths[-1]}, "
              f"over 256: {sum(n > 256 for n in lengths)}", flush=True)  # fmt: skip
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(str(entry.graph_path), opts, providers=["CPUExecutionProvider"])
    print(f"model {name}: {entry.graph_path}, max_seq_len {longest}", flush=True)
    plans = {(w, b): batches(ids, b) for w, ids in inputs.items() for b in budgets}
    for plan in plans.values():  # the arena sees every shape once
        rate(session, plan[:1] + plan[-1:], 0.0)
    got: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for b in budgets if r % 2 == 0 else list(reversed(budgets)):
            for w in inputs:
                got.setdefault((w, b), []).append(rate(session, plans[(w, b)], seconds))
        print(f"round {r}: " + ", ".join(f"{w} {b} {v[-1]:.2f}" for (w, b), v in got.items()), flush=True)
    print("\ntexts a second, medians of the rounds (and / the largest budget's):")
    for w in inputs:
        top = statistics.median(got[(w, max(budgets))])
        cells = [f"{b}: {statistics.median(got[(w, b)]):.2f} ({statistics.median(got[(w, b)]) / top:.2f})"
                 for b in budgets]  # fmt: skip
        print(f"  {w}: " + ", ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), [int(b) for b in sys.argv[5:]])
