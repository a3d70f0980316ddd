"""The tokenizer file a repository entry ships: configured for serving, or made up for random models."""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def for_serving(tokenizer: Tokenizer, max_seq_len: int) -> Tokenizer:
    """No fixed padding (the batcher pads to each batch's longest), truncation at the model's max length.

    MiniLM's tokenizer.json ships padding to 128 and truncation at 128; sentence-transformers overrides
    both (max_seq_length 256), so a server that used the file as shipped would embed different tokens.
    """
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_seq_len)
    return tokenizer


def load_for_serving(path: Path, max_seq_len: int) -> Tokenizer:
    return for_serving(Tokenizer.from_file(str(path)), max_seq_len)


def synthetic(vocab_size: int) -> Tokenizer:
    """A BERT-style WordPiece tokenizer of exactly `vocab_size` entries, for randomly initialised models.

    It knows the special tokens, single characters (as word starts and as '##' continuations) and fills
    the rest with unused slots, so any text tokenises and every id is inside the embedding table.
    """
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = SPECIALS + chars + ["##" + c for c in string.ascii_lowercase + string.digits]
    if vocab_size < len(vocab):
        raise ValueError(f"a synthetic tokenizer needs vocab_size >= {len(vocab)}, got {vocab_size}")
    vocab += [f"[unused{i}]" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.decoder = decoders.WordPiece()
    return tok
