"""Pooling token states to one vector per sequence."""

from __future__ import annotations

from torch import Tensor, nn

from mhaserve.model.config import PoolingMode


class Pooling(nn.Module):
    """Mean over the real (unmasked) tokens, or the first ([CLS]) token's state (EncoderConfig checked which)."""

    def __init__(self, mode: PoolingMode) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        """x: (B, T, d), attention_mask: (B, T) -> (B, d)."""
        if self.mode == "cls":
            return x[:, 0]
        m = attention_mask.unsqueeze(-1).to(x.dtype)  # (B, T, 1)
        # clamp as sentence-transformers does, so an all-padding row gives zeros, not NaN
        return (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
