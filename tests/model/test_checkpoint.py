"""Loading real weights: strictly, with one-line errors, and faithful to sentence-transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from mhaserve.model.checkpoint import CheckpointError, default_source, load_encoder, map_key
from mhaserve.runtime.tokenizer import for_serving
from tests.conftest import VARIED_TEXTS


@pytest.fixture
def ckpt_copy(tmp_path: Path) -> Path:
    """A writable copy of the MiniLM checkpoint directory (weights symlinked unless a test rewrites them)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(default_source(), dst, ignore=shutil.ignore_patterns("model.safetensors"))
    (dst / "model.safetensors").symlink_to(default_source() / "model.safetensors")
    return dst


def test_minilm_config_is_read_from_the_checkpoint() -> None:
    model, ckpt = load_encoder(default_source())
    cfg = ckpt.config
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_ff) == (6, 384, 12, 1536)
    assert (cfg.max_seq_len, cfg.max_positions, cfg.vocab_size) == (256, 512, 30522)
    assert cfg.pooling == "mean" and cfg.normalize is True
    assert sum(p.numel() for p in model.parameters()) == 22_565_376  # all-MiniLM-L6-v2 without its pooler


def test_key_mapping() -> None:
    assert map_key("encoder.layer.3.attention.self.query.weight") == "layers.3.attn.q.weight"
    assert map_key("bert.encoder.layer.0.output.LayerNorm.bias") == "layers.0.norm2.bias"
    assert map_key("embeddings.token_type_embeddings.weight") == "embeddings.token_type.weight"
    assert map_key("cls.predictions.bias") is None


def _rewrite_weights(ckpt: Path, edit: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(str(default_source() / "model.safetensors"))
    for k, v in edit.items():
        if v is None:
            del tensors[k]
        else:
            tensors[k] = v
    (ckpt / "model.safetensors").unlink()
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_weight_is_an_error(ckpt_copy: Path) -> None:
    _rewrite_weights(ckpt_copy, {"encoder.layer.2.attention.self.key.bias": None})
    with pytest.raises(CheckpointError, match=r"missing \['layers.2.attn.k.bias'\]"):
        load_encoder(ckpt_copy)


def test_unexpected_weight_is_an_error(ckpt_copy: Path) -> None:
    _rewrite_weights(ckpt_copy, {"cls.predictions.bias": torch.zeros(30522)})
    with pytest.raises(CheckpointError, match="unexpected.*cls.predictions.bias"):
        load_encoder(ckpt_copy)


def test_wrong_shape_is_an_error(ckpt_copy: Path) -> None:
    _rewrite_weights(ckpt_copy, {"encoder.layer.0.intermediate.dense.bias": torch.zeros(7)})
    with pytest.raises(CheckpointError, match="does not fit"):
        load_encoder(ckpt_copy)


def test_unsupported_architecture(ckpt_copy: Path) -> None:
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg.update(model_type="roberta", architectures=["RobertaModel"])
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture.*roberta"):
        load_encoder(ckpt_copy)


def test_missing_tokenizer(ckpt_copy: Path) -> None:
    (ckpt_copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_encoder(ckpt_copy)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        load_encoder(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_encoder(tmp_path)


@pytest.mark.slow
def test_eager_minilm_matches_sentence_transformers(sentence_transformer) -> None:
    """Our model and tokenizer settings against sentence-transformers' own encode: cosine >= 0.99999."""
    model, ckpt = load_encoder(default_source())
    tok = for_serving(Tokenizer.from_file(str(ckpt.tokenizer_path)), ckpt.config.max_seq_len)
    want = sentence_transformer.encode(VARIED_TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    for text, ref in zip(VARIED_TEXTS, want, strict=True):
        enc = tok.encode(text)
        assert len(enc.ids) <= 256
        with torch.no_grad():
            got = model(torch.tensor([enc.ids]), torch.tensor([enc.attention_mask]))[0].numpy()
        cos = float(got @ ref / np.linalg.norm(got))
        assert cos >= 0.99999, (text[:40], cos)
