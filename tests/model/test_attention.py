"""MultiHeadAttention against independent implementations given the same weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mhaserve.model.config import EncoderConfig
from mhaserve.model.encoder import MultiHeadAttention, init_weights


def _ours_and_torch(cfg: EncoderConfig) -> tuple[MultiHeadAttention, torch.nn.MultiheadAttention]:
    torch.manual_seed(0)
    ours = MultiHeadAttention(cfg).eval()
    ours.apply(lambda m: init_weights(m, std=0.1))  # outputs O(1), as in trained models
    ref = torch.nn.MultiheadAttention(cfg.d_model, cfg.n_heads, batch_first=True).eval()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q.weight, ours.k.weight, ours.v.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q.bias, ours.k.bias, ours.v.bias]))
        ref.out_proj.weight.copy_(ours.o.weight)
        ref.out_proj.bias.copy_(ours.o.bias)
    return ours, ref


def _inputs(cfg: EncoderConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 9, cfg.d_model, generator=g)
    lengths = torch.tensor([9, 4, 1])
    pad = torch.arange(9)[None, :] >= lengths[:, None]  # (B, T) True where padding
    additive = torch.where(pad, torch.finfo(torch.float32).min, 0.0)[:, None, None, :]  # (B, 1, 1, T)
    return x, pad, additive


@pytest.mark.parametrize("heads", [1, 4, 8])
def test_matches_torch_multihead_attention(tiny_cfg: EncoderConfig, heads: int) -> None:
    cfg = EncoderConfig(**{**tiny_cfg.to_dict(), "n_heads": heads})
    ours, ref = _ours_and_torch(cfg)
    x, pad, additive = _inputs(cfg)
    with torch.no_grad():
        got = ours(x, additive)
        want, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
    assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()


def test_matches_scaled_dot_product_attention(tiny_cfg: EncoderConfig) -> None:
    ours, _ = _ours_and_torch(tiny_cfg)
    x, pad, _ = _inputs(tiny_cfg)
    B, T, d = x.shape
    h, dk = tiny_cfg.n_heads, tiny_cfg.d_k
    with torch.no_grad():
        q, k, v = (lin(x).view(B, T, h, dk).transpose(1, 2) for lin in (ours.q, ours.k, ours.v))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :])  # default scale 1/sqrt(d_k)
        want = ours.o(attn.transpose(1, 2).reshape(B, T, d))
        got = ours(x, torch.where(pad, torch.finfo(torch.float32).min, 0.0)[:, None, None, :])
    assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()


def test_scaling_by_d_model_is_caught(tiny_cfg: EncoderConfig) -> None:
    """The classic bug (1/sqrt(d_model) instead of 1/sqrt(d_k)) must fail the comparison above."""
    ours, ref = _ours_and_torch(tiny_cfg)
    ours.scale = 1.0 / math.sqrt(tiny_cfg.d_model)
    x, pad, additive = _inputs(tiny_cfg)
    with torch.no_grad():
        got = ours(x, additive)
        want, _ = ref(x, x, x, key_padding_mask=pad, need_weights=False)
    assert (got - want).abs().max() > 1e-3


def test_padded_keys_get_no_weight(tiny_cfg: EncoderConfig) -> None:
    """Changing what sits in padded positions must not change any real position's output."""
    ours, _ = _ours_and_torch(tiny_cfg)
    x, pad, additive = _inputs(tiny_cfg)
    noisy = torch.where(pad[..., None], torch.randn_like(x) * 100, x)
    with torch.no_grad():
        a, b = ours(x, additive), ours(noisy, additive)
    real = ~pad
    assert torch.equal(a[real], b[real])
