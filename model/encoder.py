"""A Transformer encoder, written the classic way, one module per concept.

Shapes: B batch, T sequence length, d d_model, h heads, d_k = d / h.
The graph contract is `Encoder.forward(input_ids, attention_mask) -> embeddings`: tensors in,
one tensor out, no optional outputs, so that it exports to ONNX as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhaserve.model.config import EncoderConfig
from mhaserve.model.pooling import Pooling


def sinusoidal_table(n_positions: int, d_model: int) -> Tensor:
    """The fixed positional encoding of Vaswani et al.: sin on even, cos on odd dimensions."""
    position = torch.arange(n_positions, dtype=torch.float32)[:, None]  # (P, 1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(n_positions, d_model)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div[: d_model // 2])
    return table  # (P, d)


class Embeddings(nn.Module):
    """Token embedding + positional information + token type 0, then LayerNorm (BERT's order)."""

    sinusoid: Tensor

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions: nn.Embedding | None
        if cfg.positional == "learned":
            self.positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        else:
            self.positions = None
            self.register_buffer("sinusoid", sinusoidal_table(cfg.max_positions, cfg.d_model), persistent=False)
        # Every input is a single segment, so only row 0 of the token-type table is ever added;
        # BERT checkpoints were trained with it, and leaving it out shifts every embedding.
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: Tensor) -> Tensor:
        T = input_ids.shape[1]
        x = self.tokens(input_ids)  # (B, T, d)
        table = self.positions.weight if self.positions is not None else self.sinusoid  # (P, d)
        x = x + table[:T]  # (T, d) broadcast over B
        x = x + self.token_type.weight[0]
        return self.norm(x)


class MultiHeadAttention(nn.Module):
    """Scaled dot-product self-attention over h heads: softmax(Q K^T / sqrt(d_k)) V, concat, W_O."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.d_k = cfg.d_k
        # Scale by the head width d_k, not d_model: each score is a dot product of d_k terms, and
        # 1/sqrt(d_k) keeps its variance near 1 whatever the number of heads.
        self.scale = 1.0 / math.sqrt(cfg.d_k)
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.o = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x: (B, T, d); mask: (B, 1, 1, T) additive, 0 for real keys, a huge negative for padding."""
        B, T, d = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.reshape(B, T, self.n_heads, self.d_k).transpose(1, 2)  # (B, h, T, d_k)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = (q @ k.transpose(-2, -1)) * self.scale  # (B, h, T, T)
        weights = (scores + mask).softmax(dim=-1)
        out = weights @ v  # (B, h, T, d_k)
        out = out.transpose(1, 2).reshape(B, T, d)  # concat heads: (B, T, d)
        return self.o(out)


class FeedForward(nn.Module):
    """Position-wise feed-forward network: Linear, GELU (exact, erf), Linear."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))  # (B, T, d_ff) -> (B, T, d)


class EncoderLayer(nn.Module):
    """Attention and feed-forward sublayers, each with a residual and a LayerNorm after (post-LN, as BERT)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.norm1(x + self.attn(x, mask))
        return self.norm2(x + self.ffn(x))


class Encoder(nn.Module):
    """The whole model: embeddings, N layers, pooling to one vector per sequence (not normalised)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        self.pool = Pooling(cfg.pooling)

    def blocks(self) -> list[EncoderLayer]:
        """The layers, typed (ModuleList items are plain Modules to a type checker)."""
        return [layer for layer in self.layers if isinstance(layer, EncoderLayer)]

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """input_ids, attention_mask: (B, T) int64 -> embeddings (B, d) float32."""
        return self.pool(self.token_states(input_ids, attention_mask), attention_mask)  # (B, d)

    def token_states(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The last layer's output before pooling, (B, T, d): what Hugging Face calls last_hidden_state."""
        x = self.embeddings(input_ids)  # (B, T, d)
        # Additive key mask: exp(min - max) underflows to exactly 0, so padding gets no weight.
        # finfo.min rather than -inf keeps an all-padding row finite instead of NaN.
        keep = attention_mask[:, None, None, :].to(x.dtype)  # (B, 1, 1, T)
        mask = (1.0 - keep) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, mask)
        return x


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """BERT's initialisation: normal(0, std) weights, zero biases, unit LayerNorm."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def random_encoder(cfg: EncoderConfig, seed: int = 0) -> Encoder:
    """A model of any size with reproducible random weights, for tests and benchmarks."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Encoder(cfg)
        model.apply(init_weights)
    return model.eval()
