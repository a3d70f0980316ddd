"""Tokenizers made up for random models (a real checkpoint brings its own; see mhaserve.runtime.tokenizer)."""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _known() -> list[str]:
    """The entries every synthetic tokenizer has: the specials, then single characters."""
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    return SPECIALS + chars + ["##" + c for c in string.ascii_lowercase + string.digits]


def check_synthetic_size(vocab_size: int) -> None:
    """ValueError for a vocabulary too small to hold `_known()`: checked apart from `synthetic` so that
    `mhaserve export` refuses such a --vocab-size before the export begins."""
    if vocab_size < (needed := len(_known())):
        raise ValueError(f"a synthetic tokenizer needs vocab_size >= {needed}, got {vocab_size}")


def synthetic(vocab_size: int) -> Tokenizer:
    """A BERT-style WordPiece tokenizer of exactly `vocab_size` entries, for randomly initialised models.

    It knows the special tokens, single characters (as word starts and as '##' continuations) and fills
    the rest with unused slots, so any text tokenises and every id is inside the embedding table.
    """
    check_synthetic_size(vocab_size)
    vocab = _known()
    vocab += [f"[unused{i}]" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.decoder = decoders.WordPiece()
    # Known as special, as a checkpoint's tokenizer has them: decoding skips them when asked
    tok.add_special_tokens(SPECIALS)
    return tok
