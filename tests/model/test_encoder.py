"""The encoder as a whole: shapes, pooling, padding invariance, positional options, seeds, config checks."""

from __future__ import annotations

import math

import pytest
import torch

from mhaserve.model.config import EncoderConfig
from mhaserve.model.encoder import random_encoder, sinusoidal_table


def _batch(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def test_output_shape_and_dtype(tiny_cfg: EncoderConfig) -> None:
    model = random_encoder(tiny_cfg)
    ids, mask = _batch([7, 3], tiny_cfg.vocab_size)
    with torch.no_grad():
        out = model(ids, mask)
    assert out.shape == (2, tiny_cfg.d_model) and out.dtype == torch.float32


@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_padding_never_changes_a_row(tiny_cfg: EncoderConfig, positional: str, pooling: str) -> None:
    """A sentence alone and the same sentence padded inside a batch of longer ones embed the same."""
    cfg = EncoderConfig(**{**tiny_cfg.to_dict(), "positional": positional, "pooling": pooling})
    model = random_encoder(cfg, seed=3)
    ids, mask = _batch([40, 6, 23], cfg.vocab_size)
    with torch.no_grad():
        batched = model(ids, mask)
        alone = model(ids[1:2, :6], mask[1:2, :6])
    assert torch.allclose(batched[1], alone[0], atol=1e-6, rtol=0)


def test_mean_pooling_averages_real_tokens_only(tiny_cfg: EncoderConfig) -> None:
    model = random_encoder(tiny_cfg)
    ids, mask = _batch([5, 2], tiny_cfg.vocab_size)
    with torch.no_grad():
        x = model.embeddings(ids)
        additive = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for layer in model.layers:
            x = layer(x, additive)
        pooled = model(ids, mask)
    assert torch.allclose(pooled[1], x[1, :2].mean(0), atol=1e-6)


def test_sinusoidal_table() -> None:
    t = sinusoidal_table(50, 16)
    assert t.shape == (50, 16)
    assert torch.allclose(t[0, 0::2], torch.zeros(8)) and torch.allclose(t[0, 1::2], torch.ones(8))
    assert math.isclose(t[3, 0].item(), math.sin(3.0), abs_tol=1e-6)
    assert math.isclose(t[3, 3].item(), math.cos(3.0 / 10000 ** (2 / 16)), abs_tol=1e-6)


def test_random_models_are_reproducible_from_the_seed(tiny_cfg: EncoderConfig) -> None:
    a, b, c = random_encoder(tiny_cfg, seed=1), random_encoder(tiny_cfg, seed=1), random_encoder(tiny_cfg, seed=2)
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), n
    assert not torch.equal(a.embeddings.tokens.weight, c.embeddings.tokens.weight)


def test_random_models_of_any_size() -> None:
    cfg = EncoderConfig(vocab_size=1000, d_model=96, n_layers=3, n_heads=6, d_ff=200, max_positions=40, max_seq_len=32)
    model = random_encoder(cfg)
    assert len(model.layers) == 3 and model.blocks()[0].attn.d_k == 16
    ids, mask = _batch([32, 1], 1000)
    with torch.no_grad():
        assert model(ids, mask).shape == (2, 96)


@pytest.mark.parametrize(
    "bad",
    [
        {"d_model": 30, "n_heads": 4},
        {"max_seq_len": 0},
        {"max_seq_len": 600, "max_positions": 512},
        {"positional": "rotary"},
        {"pooling": "max"},
        {"n_layers": 0},
    ],
)
def test_config_refuses_inconsistent_sizes(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        EncoderConfig(**bad)  # type: ignore[arg-type]
