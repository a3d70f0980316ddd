"""The benchmark's workloads, built once and measured identically in-process and through the server.

- fixed: every input exactly N tokens (corpus text, pre-tokenised, [CLS] ... [SEP]), sent as token ids:
  no padding anywhere and no tokenisation on the server, so the server is compared with ONNX Runtime
  on exactly the work ONNX Runtime does.
- mixed: texts drawn from the corpus (queries to paragraphs, truncated at the model's maximum), sent
  as text: the server tokenises, and batching policy decides how much padding the model computes.
- short: the short-text corpus (loadtest/texts/short.txt: queries, sentences and a tail of paragraphs,
  median about 20 tokens), each text once in a seeded order, sent as text: the traffic most users
  send, where the work around the model weighs most.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tokenizers import Tokenizer

from mhaserve.loadtest.texts import SHORT

CORPUS = Path(__file__).resolve().parent.parent / "corpus.txt"

Payload = Literal["ids", "texts"]


@dataclass(frozen=True)
class Workload:
    """Inputs in the order clients send them; `ids` is what the model sees (after truncation)."""

    name: str
    description: str
    payload: Payload
    ids: list[list[int]]
    texts: list[str] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.ids]

    def summary(self) -> dict[str, Any]:
        lengths = sorted(self.lengths)
        n = len(lengths)
        return {
            "name": self.name,
            "description": self.description,
            "payload": self.payload,
            "inputs": n,
            "mean_tokens": sum(lengths) / n,
            "min_tokens": lengths[0],
            "median_tokens": lengths[n // 2],
            "max_tokens": lengths[-1],
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "payload": self.payload,
            "ids": self.ids,
            "texts": self.texts,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        return cls(d["name"], d["description"], d["payload"], d["ids"], d["texts"])


def load_corpus(path: Path = CORPUS) -> list[str]:
    """The non-empty lines of a corpus file (corpus.txt by default)."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        raise ValueError(f"the corpus {path} is empty")
    return lines


def fixed(tokenizer: Tokenizer, corpus: list[str], *, tokens: int, pool: int, seed: int = 0) -> Workload:
    """`pool` inputs of exactly `tokens` tokens: the corpus as one stream of word pieces, cut into pieces."""
    wrapper = tokenizer.encode("").ids  # the special tokens the model expects around a sequence
    body = tokens - len(wrapper)
    if body < 1:
        raise ValueError(f"--fixed-tokens {tokens} leaves no room between the special tokens")
    lines = list(corpus)
    random.Random(seed).shuffle(lines)
    stream = [i for e in tokenizer.encode_batch(lines, add_special_tokens=False) for i in e.ids]
    while len(stream) < body * pool:
        stream += stream
    head, tail = wrapper[: len(wrapper) // 2], wrapper[len(wrapper) // 2 :]
    ids = [head + stream[k * body : (k + 1) * body] + tail for k in range(pool)]
    return Workload("fixed", f"one input of {tokens} tokens per request, sent as token ids", "ids", ids)


def mixed(tokenizer: Tokenizer, corpus: list[str], *, pool: int, seed: int = 0) -> Workload:
    """`pool` texts drawn from the corpus with replacement, in a fixed random order."""
    texts = random.Random(seed + 1).choices(corpus, k=pool)
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    return Workload(
        "mixed", "one corpus text per request (queries to paragraphs), sent as text, truncated", "texts", ids, texts
    )


def short(tokenizer: Tokenizer, texts: list[str], *, pool: int, seed: int = 0) -> Workload:
    """`pool` texts of the short-text corpus: each at most once while the pool fits it, in a seeded order."""
    rng = random.Random(seed + 2)
    chosen = rng.sample(texts, k=pool) if pool <= len(texts) else rng.choices(texts, k=pool)
    ids = [e.ids for e in tokenizer.encode_batch(chosen)]
    return Workload(
        "short",
        "one text of the short-text corpus per request (queries, sentences, some paragraphs), sent as text",
        "texts",
        ids,
        chosen,
    )


def build(
    names: list[str] | tuple[str, ...],
    tokenizer: Tokenizer,
    *,
    max_seq_len: int,
    fixed_tokens: int,
    fixed_pool: int,
    mixed_pool: int,
    short_pool: int,
    seed: int = 0,
) -> dict[str, Workload]:
    """The named workloads (some of fixed, mixed, short) for a model's tokenizer and maximum length."""
    corpus = load_corpus()
    made = {
        "fixed": lambda: fixed(tokenizer, corpus, tokens=min(fixed_tokens, max_seq_len), pool=fixed_pool, seed=seed),
        "mixed": lambda: mixed(tokenizer, corpus, pool=mixed_pool, seed=seed),
        "short": lambda: short(tokenizer, load_corpus(SHORT), pool=short_pool, seed=seed),
    }
    return {name: made[name]() for name in names}
