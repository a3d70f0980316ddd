"""The int8 gate: an int8 graph is published only if it embeds what the fp32 graph embeds, closely enough.

An int8 graph cannot pass the parity gate (1e-5 of the eager model); it is held to its own bar instead,
measured against the fp32 graph it was quantised from, through the engine the server serves with:

- cosine similarity to the fp32 embedding of **every** input >= 0.98, and >= 0.995 on average, over the
  parity grid (random ids, batch sizes {1, 2, 3, 32} x lengths up to the model's maximum, rows partly
  padding) and over real texts (the fidelity set, and every query and passage of the retrieval set);
  each input both alone and inside a padded batch of mixed lengths, because dynamic quantisation takes
  its ranges from the whole batch (the export's int8 graph fixes them, export/quantize.py: there the two
  agree, and the gate holds for any batch);
- on the retrieval set (queries, each with a relevant passage and same-topic distractors, all passages
  in one pool): the int8 graph's best passage for a query is the fp32 graph's for >= 95% of the queries,
  and its ten best share >= 0.9 with the fp32 graph's ten best on average.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from mhaserve.export import parity
from mhaserve.runtime.engine import Engine

MIN_COSINE = 0.98
MEAN_COSINE = 0.995
TOP1_AGREEMENT = 0.95
TOP10_OVERLAP = 0.9
BATCH = 16  # rows per padded batch of texts
TOP_K = 10

Ids = npt.NDArray[np.int64]
Embeddings = npt.NDArray[np.float32]


class Int8GateError(RuntimeError):
    """The int8 graph failed its gate; the message gives the figures."""


def _data(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(resources.files("mhaserve.export").joinpath("gate", name).read_text("utf-8"))
    return data


def fidelity_texts() -> list[str]:
    texts: list[str] = _data("fidelity.json")["texts"]
    return texts


def calibration_texts() -> list[str]:
    """The texts whose activations set the int8 graph's fixed ranges (export/quantize.py): none of the gate's."""
    texts: list[str] = _data("calibration.json")["texts"]
    return texts


def retrieval_set() -> list[tuple[str, list[str]]]:
    """(query, passages) pairs; the first passage of each answers its query."""
    return [(item["query"], list(item["passages"])) for item in _data("retrieval.json")["items"]]


@dataclass
class Int8Report:
    """The gate's figures; `passed` says whether the graph may be published."""

    min_cosine: float = 1.0
    mean_cosine: float = 1.0
    worst_input: str = ""
    min_cosine_alone: float = 1.0
    min_cosine_batched: float = 1.0
    inputs: int = 0  # each measured alone and batched
    sets: dict[str, dict[str, float]] = field(default_factory=dict)
    retrieval: dict[str, float] = field(default_factory=dict)
    thresholds: dict[str, float] = field(
        default_factory=lambda: {
            "min_cosine": MIN_COSINE,
            "mean_cosine": MEAN_COSINE,
            "top1_agreement": TOP1_AGREEMENT,
            "top10_overlap": TOP10_OVERLAP,
        }
    )
    provider: str = ""

    @property
    def failures(self) -> list[str]:
        out = []
        if self.min_cosine < MIN_COSINE:
            out.append(f"min cosine {self.min_cosine:.4f} < {MIN_COSINE} ({self.worst_input})")
        if self.mean_cosine < MEAN_COSINE:
            out.append(f"mean cosine {self.mean_cosine:.4f} < {MEAN_COSINE}")
        if self.retrieval.get("top1_agreement", 0.0) < TOP1_AGREEMENT:
            out.append(f"top-1 agreement {self.retrieval.get('top1_agreement', 0.0):.3f} < {TOP1_AGREEMENT}")
        if self.retrieval.get("top10_overlap", 0.0) < TOP10_OVERLAP:
            out.append(f"top-10 overlap {self.retrieval.get('top10_overlap', 0.0):.3f} < {TOP10_OVERLAP}")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"passed": self.passed}

    def require_passed(self) -> Int8Report:
        """This report, or Int8GateError with the figures when the int8 graph is not faithful enough."""
        if not self.passed:
            raise Int8GateError(f"int8 gate failed: {'; '.join(self.failures)}")
        return self


def _unit(x: Embeddings) -> Embeddings:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _cosines(a: Embeddings, b: Embeddings) -> npt.NDArray[np.float64]:
    # NaN compares false with every bound (it would pass the gate, and min() skips it): as far off as can be
    return np.nan_to_num((_unit(a).astype(np.float64) * _unit(b)).sum(axis=1), nan=-1.0)


def _pad(rows: list[list[int]], pad_id: int) -> tuple[Ids, Ids]:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return ids, mask


class _Measure:
    """Runs both graphs over inputs, alone and batched, and keeps every cosine with a name for the worst."""

    def __init__(self, reference: Engine, candidate: Engine, pad_id: int) -> None:
        self.reference, self.candidate, self.pad_id = reference, candidate, pad_id
        self.alone: list[tuple[float, str]] = []
        self.batched: list[tuple[float, str]] = []

    def rows(self, rows: list[list[int]], names: list[str], order: list[list[int]]) -> tuple[Embeddings, Embeddings]:
        """Embed each row alone with both graphs, then in the batches `order` (indices) with the candidate.

        Returns (reference, candidate-in-batches) embeddings, one row per input.
        """
        ref = np.concatenate([self.reference.run(*_pad([r], self.pad_id)) for r in rows])
        alone = np.concatenate([self.candidate.run(*_pad([r], self.pad_id)) for r in rows])
        batched = np.zeros_like(alone)
        for idx in order:
            batched[idx] = self.candidate.run(*_pad([rows[i] for i in idx], self.pad_id))
        for cos, name in zip(_cosines(ref, alone), names, strict=True):
            self.alone.append((float(cos), f"{name}, alone"))
        for idx in order:
            for i, cos in zip(idx, _cosines(ref[idx], batched[idx]), strict=True):
                self.batched.append((float(cos), f"{names[i]}, in a padded batch of {len(idx)}"))
        return ref, batched


def _summary(values: list[tuple[float, str]]) -> dict[str, float]:
    cos = [c for c, _ in values]
    return {"inputs": len(cos), "min_cosine": min(cos), "mean_cosine": float(np.mean(cos))}


def check(
    reference: Engine,
    candidate: Engine,
    tokenizer: Tokenizer,
    *,
    max_seq_len: int,
    vocab_size: int,
    pad_id: int,
    seed: int = 0,
) -> Int8Report:
    """Measure `candidate` (the int8 graph) against `reference` (the fp32 graph it was quantised from)."""
    report = Int8Report(provider=candidate.providers[0])
    shuffle = random.Random(seed)

    # The parity grid: random ids, rows partly padding, alone and in their own batch.
    grid = _Measure(reference, candidate, pad_id)
    rng = np.random.default_rng(seed)
    for batch, seq in parity.grid(max_seq_len):
        ids, mask = parity.make_batch(batch, seq, vocab_size, pad_id, rng)
        rows = [ids[i, : int(mask[i].sum())].tolist() for i in range(batch)]
        names = [f"grid batch {batch} x seq {seq}, row {i} ({len(r)} tokens)" for i, r in enumerate(rows)]
        grid.rows(rows, names, [list(range(batch))])

    # Real texts: the fidelity set, then the retrieval set's queries and passages; batches of mixed lengths.
    items = retrieval_set()
    queries = [q for q, _ in items]
    passages = [p for _, ps in items for p in ps]
    relevant = np.cumsum([0] + [len(ps) for _, ps in items[:-1]])
    texts = fidelity_texts() + queries + passages
    encoded = [e.ids for e in tokenizer.encode_batch(texts)]
    order = list(range(len(texts)))
    shuffle.shuffle(order)
    batches = [order[k : k + BATCH] for k in range(0, len(order), BATCH)]
    real = _Measure(reference, candidate, pad_id)
    names = [f"text {t[:40]!r}" for t in texts]
    ref, batched = real.rows(encoded, names, batches)

    alone = grid.alone + real.alone
    every = alone + grid.batched + real.batched
    worst = min(every)
    report.min_cosine, report.worst_input = worst
    report.mean_cosine = float(np.mean([c for c, _ in every]))
    report.min_cosine_alone = min(c for c, _ in alone)
    report.min_cosine_batched = min(c for c, _ in grid.batched + real.batched)
    report.inputs = len(alone)
    report.sets = {
        "grid_alone": _summary(grid.alone),
        "grid_batched": _summary(grid.batched),
        "texts_alone": _summary(real.alone),
        "texts_batched": _summary(real.batched),
    }

    # Retrieval: queries alone (as a search request comes), passages as embedded in batches (as an index is built).
    n_fid, n_q = len(fidelity_texts()), len(queries)
    q_ref, p_ref = _unit(ref[n_fid : n_fid + n_q]), _unit(ref[n_fid + n_q :])
    q_alone = np.concatenate([candidate.run(*_pad([r], pad_id)) for r in encoded[n_fid : n_fid + n_q]])
    q_int8, p_int8 = _unit(q_alone), _unit(batched[n_fid + n_q :])
    top_ref = np.argsort(-(q_ref @ p_ref.T), axis=1, kind="stable")[:, :TOP_K]
    top_int8 = np.argsort(-(q_int8 @ p_int8.T), axis=1, kind="stable")[:, :TOP_K]
    report.retrieval = {
        "queries": n_q,
        "passages": len(passages),
        "top1_agreement": float(np.mean(top_ref[:, 0] == top_int8[:, 0])),
        "top10_overlap": float(np.mean([len(set(a) & set(b)) / TOP_K for a, b in zip(top_ref, top_int8, strict=True)])),
        "fp32_recall_at_1": float(np.mean(top_ref[:, 0] == relevant)),
        "int8_recall_at_1": float(np.mean(top_int8[:, 0] == relevant)),
    }
    return report
