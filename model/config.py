"""The encoder's configuration: one frozen dataclass that describes every size and choice."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

Positional = Literal["learned", "sinusoidal"]
PoolingMode = Literal["mean", "cls"]


@dataclass(frozen=True)
class EncoderConfig:
    """Sizes and choices of a BERT-family encoder.

    The defaults are those of all-MiniLM-L6-v2, the default model.
    """

    vocab_size: int = 30522
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 12
    d_ff: int = 1536
    # Rows of the position table; a longer sequence cannot be encoded.
    max_positions: int = 512
    # Longest input the model is served with (sentence-transformers' max_seq_length), special tokens included;
    # in 2..max_positions.
    max_seq_len: int = 256
    type_vocab_size: int = 2
    positional: Positional = "learned"
    layer_norm_eps: float = 1e-12
    pooling: PoolingMode = "mean"
    # Whether the model's users expect unit vectors (the server applies it; the graph does not).
    normalize: bool = True
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "type_vocab_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.max_positions < 3:
            # The export traces sequences of 3 (an example dimension below 2 would be frozen into the graph).
            raise ValueError(f"max_positions must be at least 3, got {self.max_positions}")
        if self.max_seq_len < 2:
            # [CLS] and [SEP] take two tokens of every input: a model of 1 was published and refused every text
            # (runtime/serving.py refuses a serving.json max_length below 2 for the same reason).
            raise ValueError(f"max_seq_len must be >= 2 (special tokens included), got {self.max_seq_len}")
        if self.max_seq_len > self.max_positions:
            raise ValueError(f"max_seq_len {self.max_seq_len} must be in 2..max_positions ({self.max_positions})")
        if self.positional not in ("learned", "sinusoidal"):
            raise ValueError(f"unknown positional encoding {self.positional!r}")
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"unknown pooling {self.pooling!r}")

    @property
    def d_k(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EncoderConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown encoder config keys: {sorted(unknown)}")
        return cls(**d)


# A model small enough to export in seconds, big enough to have several heads, layers and padding to
# get wrong: the tests' and `mhaserve bench --quick`'s random model.
TINY: dict[str, int] = {
    "vocab_size": 256,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "d_ff": 64,
    "max_positions": 160,
    "max_seq_len": 160,
}
