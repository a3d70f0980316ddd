"""The calibration set against inputs unlike any of its texts: the int8 graph quantised with the export's
calibration (500 short-corpus texts) and with 77 unusual texts added (punctuation runs, numbers, code, emoji,
other scripts, none of the gate's), each through the int8 gate, then texts unlike both (a review's list).
Run from the repository root: python docs/bench/2026-12-06-seventythird/int8-static/calibration_wider.py
"""

import sys
from pathlib import Path

import numpy as np

from mhaserve.export import int8_gate as g
from mhaserve.export import quantize
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.tokenizer import load_for_serving

EXTRA = [
    "?????",
    "!!",
    "…",
    "... ... ...",
    "***",
    "-----------",
    "==========",
    "~~~~",
    "((( )))",
    "[[ ]]",
    "{}",
    "<<>>",
    "////",
    "\\\\",
    "? ? ? ? ?",
    "!?!?",
    ";;;;",
    "::::",
    "' ' '",
    "#",
    "@@@",
    "+++++",
    "_____",
    "%%%",
    "^^",
    "&&",
    "||||",
    "42",
    "3.14159265358979",
    "2024-06-01 12:00:00",
    "0000000000",
    "9 8 7 6 5 4 3 2 1 0",
    "1,234,567.89",
    "for i in range(10): print(i)",
    "if (x > 0) { return y; }",
    '{"key": [1, 2, {"a": null}]}',
    '<div class="x"><p>hi</p></div>',
    "SELECT name FROM t;",
    "x = y + z * 2",
    "#include <stdio.h>",
    'git commit -m "fix"',
    "😀",
    "🎉🎉🎉",
    "👍🏽 ok",
    "❤️",
    "→ ← ↑ ↓",
    "© ® ™",
    "½ ¼ ¾",
    "°C",
    "µs ms s",
    "日本語",
    "한국어 텍스트",
    "Русский текст",
    "العربية",
    "עברית",
    "हिन्दी",
    "ไทย",
    "Ελληνικά",
    "Tiếng Việt",
    "ok",
    "k",
    "no",
    "yes",
    "hmm",
    "lol",
    "thx",
    "brb",
    "???",
    "¿qué?",
    "¡hola!",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "A" * 40,
    "ab" * 30,
    "the " * 50,
    "?" * 100,
    "." * 120,
    "!" * 60,
]
WEIRD = [
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
    "................................................................",
    "0 1 2 3 4 5 6 7 8 9 " * 20,
    "def f(x):\n    return {'a': [1, 2, 3]}\n" * 8,
    "🙂🙂🙂 😀 👍",
    "[UNK] " * 100,
    "The the the the the the the the the " * 20,
    "https://example.com/a/b/c?d=e&f=g#h " * 10,
    "Ωμέγα Ελληνικά κείμενο " * 10,
    "中文文本测试 " * 30,
    "",
    "a",
    "SELECT * FROM users WHERE id = 1; " * 10,
    ", , , , , , , , , , , , , , , , , , , , , , , , , , , , , , , , , , , , , , ,",
    "- " * 200,
    '""""""""""""',
    "| --- | --- | --- |\n" * 20,
    "1234567890" * 30,
    "###### ##### #### ###",
    "$$$$ %%%% ^^^^ &&&&",
]

d = Path("models/all-minilm-l6-v2/2")
tok = load_for_serving(d / "tokenizer.json", 256)
ref = OnnxEngine(d / "model.optimized.onnx", max_seq_len=256, vocab_size=30522, device="cpu")
for name, texts in (("the export's", g.calibration_texts()), ("with the unusual texts", g.calibration_texts() + EXTRA)):
    out = Path(f"/tmp/calibration-{len(texts)}.onnx")
    quantize.quantize(d / "model.optimized.onnx", out, calibration=[e.ids for e in tok.encode_batch(texts)])
    c = OnnxEngine(out, max_seq_len=256, vocab_size=30522, device="cpu")
    r = g.check(ref, c, tok, max_seq_len=256, vocab_size=30522, pad_id=0)
    cs = []
    for t in WEIRD:
        ids = np.array([tok.encode(t).ids])
        a, b = ref.run(ids, np.ones_like(ids))[0], c.run(ids, np.ones_like(ids))[0]
        cs.append((float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), t[:20]))
    cs.sort()
    print(
        f"{name} ({len(texts)} texts): gate min {r.min_cosine:.5f} ({r.worst_input}), mean {r.mean_cosine:.5f}, "
        f"top-10 {r.retrieval['top10_overlap']:.3f}; unusual texts' worst: {[(round(x, 4), t) for x, t in cs[:4]]}"
    )
# the graph exported before fixed ranges (version 1: per-batch ranges), each text alone
c = OnnxEngine(Path("models/all-minilm-l6-v2/1/model.int8.onnx"), max_seq_len=256, vocab_size=30522, device="cpu")
cs = []
for t in WEIRD:
    ids = np.array([tok.encode(t).ids])
    a, b = ref.run(ids, np.ones_like(ids))[0], c.run(ids, np.ones_like(ids))[0]
    cs.append((float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), t[:20]))
print("per-batch ranges (version 1), alone:", sorted((round(x, 4), t) for x, t in cs)[:4],
      [(round(x, 4), t) for x, t in cs if t.startswith("....")])  # fmt: skip
sys.exit(0)
