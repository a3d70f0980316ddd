"""The serving tokenizer: an entry's tokenizer.json, configured as the server (and the export) use it."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


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
