"""No regression on the fixed and mixed workloads, with today's defaults: the fifth session's regress.py again.

Issue 18 asks that its changes not slow the fixed (128 tokens, sent as ids) and mixed (corpus texts)
workloads. The fifth session ran the server before issue 18's work (9555cd6) against its own code, both on
the fused graph; since then the defaults changed (two inference workers on 2 cores, the CPU's token budget of
256, `optimized-cpu` served by `--graph auto` on a CPU). This runs, in alternated rounds, each server started
afresh every round, three servers:

- "before (9555cd6)": the code before issue 18's server work, with its defaults (`--graph auto` serves the
  fused graph there);
- "now, fused": this tree's server on the same fused graph (`--graph optimized`): what the code changed;
- "now": this tree's server with its defaults (`--graph auto`: `optimized-cpu` on a CPU): what a user gets.

The points, the transports, the closed loop and the workloads are regress.py's (the fifth session's
script, imported, not copied). 9555cd6 refuses today's manifest (it has a field more, `tokenizer_sha256`), so
"before" serves a repository of its own, BASE_MODELS: the same graph files with that field left out (the
commands below). Set up BASE as regress.py says, then from the repository root:
  B=/tmp/base-models/all-minilm-l6-v2/1 && mkdir -p $B
  cp models/all-minilm-l6-v2/2/{model.onnx,model.optimized.onnx,tokenizer.json} $B/
  python -c "import json, sys; m = json.load(open('models/all-minilm-l6-v2/2/manifest.json'));
  m.pop('tokenizer_sha256'); json.dump(m, open(sys.argv[1] + '/manifest.json', 'w'))" $B
  python docs/bench/2026-11-29-twentysixth/regress.py /tmp/base/.venv/bin/python ROUNDS SECONDS [WORKLOADS]
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
import regress  # noqa: E402

# regress.start passes `--graph optimized`; a later `--graph` wins (argparse keeps the last).
BASE_MODELS = "/tmp/base-models"
FLAGS = {
    "before (9555cd6)": ("--graph", "auto", "--repository", BASE_MODELS),
    "now, fused": (),
    "now": ("--graph", "auto"),
}


def main(base: str, rounds: int, seconds: float, which: str) -> None:
    workloads = regress.workloads_of(which.rstrip("0123456789").split(","))  # short32, short1: short
    pythons = {"before (9555cd6)": base, "now, fused": sys.executable, "now": sys.executable}
    rows: dict[str, dict[str, list[float]]] = {v: {} for v in pythons}
    order = list(pythons)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:  # rotated every round
            got = regress.measure(pythons[name], workloads, regress.POINTS[which], seconds, FLAGS[name])
            for k, v in got.items():
                rows[name].setdefault(k, []).append(v)
            print(f"round {r} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    before = rows["before (9555cd6)"]
    print(f"medians of {rounds} rounds; against before in the same round (median of the rounds' ratios):")
    for name in ("now, fused", "now"):
        for k, values in rows[name].items():
            ratios = [n / b for n, b in zip(values, before[k], strict=True)]
            print(f"  {name:10s} {k:22s} before {statistics.median(before[k]):7.2f}  "
                  f"{statistics.median(values):7.2f}  x{statistics.median(ratios):.3f} "
                  f"({', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "fixed,mixed")
