"""Padding a batch: sequences of different lengths as one (B, T) array of ids and its attention mask."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mhaserve.service.batching.queue import Ids


def pad(seqs: Sequence[Ids], pad_id: int) -> tuple[Ids, Ids]:
    """(B, T) ids and mask for sequences of different lengths, T the longest."""
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = s
        mask[row, : len(s)] = 1
    return ids, mask
