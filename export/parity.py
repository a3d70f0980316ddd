"""The parity gate: an exported graph is published only if it computes what the eager model computes.

It runs a grid of batch sizes x sequence lengths, with rows that are partly padding, through the eager
model and through the graph under ONNX Runtime (the server's own engine), and compares the pooled,
unnormalised embeddings. It also checks that padding never changes a row: one sentence alone and the
same sentence padded inside a batch of longer ones must embed the same.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from mhaserve.model.encoder import Encoder
from mhaserve.runtime.engine import Engine

BATCHES = (1, 2, 3, 32)
SEQ_LENS = (1, 2, 7, 128)  # and the model's maximum, added per model
FP32_TOLERANCE = 1e-5
# fp16 keeps ~3 decimal digits; pooled MiniLM values are O(1), so absolute errors of a few 1e-3 are normal.
FP16_TOLERANCE = 2e-2


class ParityError(RuntimeError):
    """The graph failed the gate; the message says by how much and where."""


@dataclass
class ParityReport:
    tolerance: float
    max_abs_diff: float = 0.0
    worst_case: tuple[int, int] = (0, 0)
    padding_max_abs_diff: float = 0.0
    min_cosine: float = 1.0
    cases: list[tuple[int, int, float]] = field(default_factory=list)
    provider: str = ""

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance and self.padding_max_abs_diff <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["cases"] = [{"batch": b, "seq": s, "max_abs_diff": x} for b, s, x in self.cases]
        return d


# The eager model holds (batch, heads, length, length) attention scores: the grid's batches shrink past 512
# tokens to keep batch x length^2 within what 32 rows of 512 take (a batch of 32 at 2,048 positions took 4 GB
# for a 2-head model, and would take 6 times that for 12 heads).
ATTENTION_BUDGET = 32 * 512 * 512


def grid(max_seq_len: int) -> list[tuple[int, int]]:
    seqs = sorted({s for s in SEQ_LENS if s <= max_seq_len} | {max_seq_len})
    cases = {(min(b, max(3, ATTENTION_BUDGET // (s * s))), s) for b in BATCHES for s in seqs}
    return sorted(cases, key=lambda bs: (BATCHES.index(bs[0]) if bs[0] in BATCHES else len(BATCHES), bs[1]))


def make_batch(
    batch: int, seq: int, vocab_size: int, pad_id: int, rng: np.random.Generator
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Random ids; row 0 is full length, later rows are shorter (the rest padding), never empty."""
    ids = rng.integers(0, vocab_size, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    for r in range(1, batch):
        length = max(1, seq - (r * seq) // batch)
        mask[r, length:] = 0
        ids[r, length:] = pad_id
    return ids, mask


def _eager(model: Encoder, ids: npt.NDArray[np.int64], mask: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
    with torch.no_grad():
        return model(torch.from_numpy(ids), torch.from_numpy(mask)).float().numpy()


def _min_cosine(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    na = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    nb = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return float((na * nb).sum(axis=1).min())


def check(model: Encoder, engine: Engine, *, tolerance: float = FP32_TOLERANCE, seed: int = 0) -> ParityReport:
    """Run the gate and return its report (the caller decides what a failure means)."""
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    report = ParityReport(tolerance=tolerance, provider=engine.providers[0])
    for batch, seq in grid(cfg.max_seq_len):
        ids, mask = make_batch(batch, seq, cfg.vocab_size, cfg.pad_token_id, rng)
        want, got = _eager(model, ids, mask), engine.run(ids, mask)
        diff = _max_abs_diff(want, got)
        report.cases.append((batch, seq, diff))
        cosine = _min_cosine(want, got)
        report.min_cosine = min(report.min_cosine, cosine if math.isfinite(cosine) else -1.0)
        if diff >= report.max_abs_diff:
            report.max_abs_diff, report.worst_case = diff, (batch, seq)

    report.padding_max_abs_diff = padding_diff(
        engine, max_seq_len=cfg.max_seq_len, vocab_size=cfg.vocab_size, pad_id=cfg.pad_token_id, rng=rng
    )
    return report


def padding_diff(
    engine: Engine, *, max_seq_len: int, vocab_size: int, pad_id: int, rng: np.random.Generator | None = None
) -> float:
    """How much padding changes a row: the same short row alone, and padded in a batch of full-length rows.

    Needs no reference model, so an imported graph is held to it as well: a graph that ignores
    attention_mask, or pools over padding, fails it.
    """
    rng = rng or np.random.default_rng(0)
    short = min(5, max_seq_len)
    long = min(64, max_seq_len)
    ids, mask = make_batch(3, long, vocab_size, pad_id, rng)
    ids[1, short:], mask[1, short:] = pad_id, 0
    mask[2] = 1
    alone = engine.run(np.ascontiguousarray(ids[1:2, :short]), np.ascontiguousarray(mask[1:2, :short]))
    padded = engine.run(ids, mask)[1:2]
    return _max_abs_diff(alone, padded)


def _max_abs_diff(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    """The largest difference, infinite where either side is not a number: NaN compares false with every
    bound, so a graph that answered NaN (an fp16 overflow, -inf in a mask) would otherwise pass."""
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float(np.nan_to_num(diff, nan=np.inf).max())


def gate(model: Encoder, engine: Engine, *, variant: str, tolerance: float = FP32_TOLERANCE) -> ParityReport:
    """`check`, raising ParityError with the figures when the graph is not faithful."""
    report = check(model, engine, tolerance=tolerance)
    if not report.passed:
        b, s = report.worst_case
        # inf is what a NaN on either side reads as (_max_abs_diff)
        nan = " (an output that is not a finite number)"
        why, padding_why = ("" if math.isfinite(x) else nan for x in (report.max_abs_diff, report.padding_max_abs_diff))
        raise ParityError(
            f"parity gate failed for the {variant} graph: max abs diff {report.max_abs_diff:.3g}{why} "
            f"(worst at batch {b}, seq {s}), padding diff {report.padding_max_abs_diff:.3g}{padding_why}, "
            f"tolerance {tolerance:g}"
        )
    return report
