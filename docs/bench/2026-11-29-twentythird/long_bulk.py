"""The nineteenth session's query_behind_bulk.py with bulk clients that send the short corpus's paragraphs of
100-150 tokens (86 of its 2,000 texts) instead of its short texts: the case a half budget costs most, two such
inputs a batch at 256 tokens and one at 128. The queries are the same short texts. Run from the repository root:
  python docs/bench/2026-11-29-twentythird/long_bulk.py BEFORE AFTER ROUNDS SECONDS
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-28-nineteenth"))
import query_behind_bulk as q  # noqa: E402


def long_texts() -> list[str]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file("models/all-minilm-l6-v2/1/tokenizer.json")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return [t for t in q.TEXTS if 100 <= len(tokenizer.encode(t).ids) <= 150]


if __name__ == "__main__":
    if sys.argv[1] == "bulk":
        q.TEXTS = long_texts()
        q.bulk(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    else:
        q.__file__ = __file__  # q.beside starts its bulk clients from this file
        q.main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
