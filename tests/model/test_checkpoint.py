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


@pytest.mark.parametrize("model_max_length", [128, 10**30])
def test_without_sentence_transformers_config_the_tokenizers_max_length_caps_it(
    ckpt_copy: Path, model_max_length: int
) -> None:
    """As sentence-transformers' Transformer module: min(max_position_embeddings, model_max_length). The
    position table alone let a checkpoint whose tokenizer says 128 read 512 tokens, another vector."""
    from sentence_transformers.models import Transformer

    (ckpt_copy / "sentence_bert_config.json").unlink()
    cfg = json.loads((ckpt_copy / "tokenizer_config.json").read_text())
    _write(ckpt_copy / "tokenizer_config.json", cfg | {"model_max_length": model_max_length})
    _, ckpt = load_encoder(ckpt_copy)
    assert ckpt.config.max_seq_len == min(512, model_max_length) == Transformer(str(ckpt_copy)).max_seq_length


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
    _rewrite_weights(ckpt_copy, {"encoder.layer.0.attention.self.rotary.weight": torch.zeros(4)})
    with pytest.raises(CheckpointError, match="unexpected.*rotary"):
        load_encoder(ckpt_copy)


def test_a_masked_lm_head_is_left_out_as_transformers_does(ckpt_copy: Path) -> None:
    """bert-base-uncased's own layout carries `cls.predictions.*`: not the encoder's, skipped, not refused."""
    _rewrite_weights(ckpt_copy, {"cls.predictions.bias": torch.zeros(30522)})
    model, _ = load_encoder(ckpt_copy)
    assert sum(p.numel() for p in model.parameters()) == 22_565_376


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # sentence-transformers would embed otherwise than the exported graph: refused, not exported without it
        ({"1_Pooling/config.json": {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}},
         "unsupported pooling .*: max, mean; only one of mean or cls"),
        ({"1_Pooling/config.json": {"pooling_mode": "max"}}, "unsupported pooling .*: max; only one"),
        ({"1_Pooling/config.json": {"pooling_mode": ["mean", "cls"]}}, "unsupported pooling .*: mean, cls; only one"),
        ({"1_Pooling/config.json": {"pooling_mode": "mean", "include_prompt": False}}, "include_prompt false"),
        ({"1_Pooling/config.json": {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}},
         "unsupported pooling"),
        ({"modules.json": [*MODULES, {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]},
         "models.Dense.* is not supported"),
        ({"modules.json": [{**MODULES[0], "path": "0_Transformer"}, MODULES[1]]}, "older layout"),
        ({"modules.json": {"not": "a list"}}, "is not a JSON list"),
        ({"config.json": {"is_decoder": True}}, "is_decoder"),
        ({"sentence_bert_config.json": {"max_seq_length": 256, "do_lower_case": True}, "tokenizer.json": "cased"},
         "do_lower_case true but tokenizer.json does not lower-case"),
        ({"tokenizer_config.json": {"do_lower_case": False}}, "do_lower_case false but tokenizer.json does lower-case"),
        # transformers builds a BERT tokenizer's normaliser from tokenizer_config.json, each key's default if absent
        ({"tokenizer_config.json": {"do_lower_case": None}, "tokenizer.json": "cased"},
         "do_lower_case true [(]its default[)] but tokenizer.json does not lower-case"),
        ({"tokenizer_config.json": {"strip_accents": False}},
         "strip_accents false but tokenizer.json does strip accents"),
        ({"tokenizer_config.json": {"tokenize_chinese_chars": False}},
         "tokenize_chinese_chars false but tokenizer.json does split Chinese characters"),
        ({"config.json": {"max_position_embeddings": None}}, "lacks whole numbers for max_position_embeddings"),
        ({"config.json": {"num_attention_heads": 7}}, "hidden_size 384 is not a multiple of num_attention_heads 7"),
        ({"config.json": {"hidden_act": "gelu_new"}}, "unsupported activation 'gelu_new'"),  # tanh's approximation
        ({"config.json": ["a", "list"]}, "is not a JSON object"),
        # a length no text fits in ([CLS] and [SEP] take two), or none at all: a bare ValueError or a model
        # published that refused every text
        ({"sentence_bert_config.json": {"max_seq_length": "many"}},
         "max_seq_length must be a whole number >= 2 [(]special tokens included[)], got \"many\""),
        ({"sentence_bert_config.json": {"max_seq_length": 1}}, "max_seq_length must be a whole number >= 2"),
        ({"sentence_bert_config.json": {"max_seq_length": 1.5}}, "max_seq_length must be a whole number >= 2"),
    ],
)  # fmt: skip
def test_what_would_embed_otherwise_is_refused_in_one_line(ckpt_copy: Path, edit: dict, message: str) -> None:
    for name, data in edit.items():
        path = ckpt_copy / name
        if name in ("config.json", "tokenizer_config.json") and isinstance(data, dict):
            data = {k: v for k, v in (json.loads(path.read_text()) | data).items() if v is not None}
        if name == "tokenizer.json":
            tokenizer = json.loads(path.read_text())
            tokenizer["normalizer"]["lowercase"] = False
            data = tokenizer
        if path.is_symlink():
            path.unlink()
        _write(path, data)
    with pytest.raises(CheckpointError, match=message):
        load_encoder(ckpt_copy)


def test_the_tokenizers_no_limit_is_no_length_even_without_a_position_table(tmp_path: Path) -> None:
    """transformers writes int(1e30) as model_max_length for a tokenizer without a limit: where the position
    table's size is unknown too (an ONNX import), it was read as the longest sequence, and the import reached
    numpy with it; a length of 1 is refused as sentence_bert_config.json's is."""
    from mhaserve.model.checkpoint import sentence_settings

    for no_limit in (int(1e30), 1e30):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": no_limit}))
        assert sentence_settings(tmp_path, None)[0] is None
        assert sentence_settings(tmp_path, 512)[0] is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    assert sentence_settings(tmp_path, None)[0] == sentence_settings(tmp_path, 512)[0] == 128
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1}))
    with pytest.raises(CheckpointError, match="model_max_length must be a whole number >= 2"):
        sentence_settings(tmp_path, 512)


def test_a_max_seq_length_past_the_position_table_is_capped_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """sentence_bert_config.json's max_seq_length past the position table is taken at the table's size (an input
    past it could not run), as before, and now said: it was lowered without a word, where --max-seq-len past
    the table is refused."""
    from mhaserve.model.checkpoint import sentence_settings

    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 1000}))
    with caplog.at_level("WARNING"):
        assert sentence_settings(tmp_path, 512)[0] == 512
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'sentence_bert_config.json'}: max_seq_length 1000 is past the model's 512 positions: "
        "inputs are taken up to 512 tokens"
    ]
    caplog.clear()
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    assert sentence_settings(tmp_path, 512)[0] == 512 and sentence_settings(tmp_path, None)[0] == 512
    assert caplog.records == []


def test_a_checkpoint_saved_by_sentence_transformers_5_or_later_is_read(sentence_transformer, tmp_path: Path) -> None:
    """Since 5, sentence-transformers writes `"pooling_mode": "mean"` where it wrote one boolean per mode: such a
    checkpoint (any saved by the installed version) was refused as "unsupported pooling: none"."""
    saved = tmp_path / "saved"
    sentence_transformer.save(str(saved))
    pool_cfg = json.loads((saved / "1_Pooling" / "config.json").read_text())
    _, ckpt = load_encoder(saved)
    assert (ckpt.config.pooling, ckpt.config.normalize, ckpt.config.max_seq_len) == ("mean", True, 256), pool_cfg
    for mode, pooling in (("cls", "cls"), (["cls"], "cls"), (["mean"], "mean")):
        _write(saved / "1_Pooling" / "config.json", pool_cfg | {"pooling_mode": mode})
        assert load_encoder(saved)[1].config.pooling == pooling
    _write(saved / "1_Pooling" / "config.json", {"pooling_mode_max_tokens": False})  # the older keys, none set
    assert load_encoder(saved)[1].config.pooling == "mean"  # as sentence-transformers reads it


@pytest.mark.parametrize(
    ("config", "normalizer"),
    [
        ({"strip_accents": False}, {"strip_accents": False}),
        ({"tokenize_chinese_chars": False}, {"handle_chinese_chars": False}),
        ({"do_lower_case": False}, {"lowercase": False}),  # strip_accents unset: as lower-casing, in both
    ],
)
def test_a_tokenizer_that_agrees_with_its_config_tokenises_as_sentence_transformers(
    ckpt_copy: Path, config: dict, normalizer: dict
) -> None:
    """Where tokenizer_config.json and tokenizer.json agree, the export's tokenizer gives sentence-transformers'
    tokens, on the texts the settings change."""
    from sentence_transformers import SentenceTransformer

    path = ckpt_copy / "tokenizer_config.json"
    _write(path, json.loads(path.read_text()) | config)
    tokenizer = json.loads((ckpt_copy / "tokenizer.json").read_text())
    tokenizer["normalizer"] |= normalizer
    (ckpt_copy / "tokenizer.json").unlink()
    _write(ckpt_copy / "tokenizer.json", tokenizer)
    _, ckpt = load_encoder(ckpt_copy)
    ours = for_serving(Tokenizer.from_file(str(ckpt.tokenizer_path)), ckpt.config.max_seq_len)
    theirs = SentenceTransformer(str(ckpt_copy), device="cpu").tokenizer
    for text in ("naïve Café Été", "中文的句子", "The Quick BROWN fox"):
        assert ours.encode(text).ids == theirs(text)["input_ids"], text


def test_sentence_transformers_prompts_are_read(ckpt_copy: Path) -> None:
    from mhaserve.model.checkpoint import sentence_prompts

    assert sentence_prompts(ckpt_copy) == ({}, "")  # MiniLM's names none
    cfg = {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"}
    _write(ckpt_copy / "config_sentence_transformers.json", cfg)
    assert sentence_prompts(ckpt_copy) == (cfg["prompts"], "query")
    _write(ckpt_copy / "config_sentence_transformers.json", cfg | {"default_prompt_name": "doc"})
    with pytest.raises(CheckpointError, match="default_prompt_name 'doc' is not one of its prompts"):
        sentence_prompts(ckpt_copy)
    _write(ckpt_copy / "config_sentence_transformers.json", {"prompts": {"q": 1}})
    with pytest.raises(CheckpointError, match="prompts must map names to prompt texts"):
        sentence_prompts(ckpt_copy)


def test_gelu_python_is_the_same_exact_gelu(ckpt_copy: Path) -> None:
    """transformers' "gelu_python" writes out the same erf GELU as "gelu": refused once, as if it approximated it."""
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    _write(ckpt_copy / "config.json", cfg | {"hidden_act": "gelu_python"})
    assert load_encoder(ckpt_copy)[1].config.d_model == 384


def test_an_older_layout_at_its_root_is_named(tmp_path: Path) -> None:
    _write(tmp_path / "modules.json", [{**MODULES[0], "path": "0_Transformer"}])
    with pytest.raises(CheckpointError, match="older layout"):
        load_encoder(tmp_path)


def test_damaged_weights_are_one_line(ckpt_copy: Path) -> None:
    (ckpt_copy / "model.safetensors").unlink()
    (ckpt_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read"):
        load_encoder(ckpt_copy)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_weight_that_is_not_a_number_is_named(ckpt_copy: Path, value: float) -> None:
    """A NaN or infinite weight (a damaged or diverged checkpoint) was exported, and the parity gate failed on
    it saying "max abs diff inf": the weight is named at load."""
    bias = load_file(str(default_source() / "model.safetensors"))["encoder.layer.3.output.dense.bias"].clone()
    bias[7] = value
    _rewrite_weights(ckpt_copy, {"encoder.layer.3.output.dense.bias": bias})
    with pytest.raises(CheckpointError) as e:
        load_encoder(ckpt_copy)
    assert str(e.value) == (
        f"{ckpt_copy / 'model.safetensors'}: encoder.layer.3.output.dense.bias holds a value that is not a finite "
        "number (NaN or infinite): a damaged or diverged checkpoint"
    )


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
