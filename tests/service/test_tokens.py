"""A text's tokens as /tokenize and tei.v1's Tokenize show them, with a prompt put before the text."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tokenizers import Encoding

from mhaserve.model.checkpoint import default_source
from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.service.pipeline import EncodeInput
from mhaserve.service.tokens import Token, tokenize


class _Prompting:
    """The part of a Pipeline that `tokenize` uses, on MiniLM's WordPiece tokenizer, with one prompt."""

    def __init__(self, prompt: str) -> None:
        self.text = prompt
        self.tokenizer = load_for_serving(default_source() / "tokenizer.json", 256)

    def validate(self, req: EncodeInput) -> None:
        pass

    def prompt(self, req: EncodeInput) -> str:
        return self.text

    def prompted(self, req: EncodeInput) -> Sequence[str]:
        return [self.text + text for text in req.texts]

    async def tokenize(self, texts: Sequence[str], *, truncate: bool, prompted: bool = False) -> list[Encoding]:
        return self.tokenizer.encode_batch(list(texts))

    async def tokenize_whole(
        self, texts: Sequence[str], *, prompted: bool = False, truncatable: bool = True
    ) -> list[Encoding]:
        return self.tokenizer.encode_batch(list(texts))


def _tokens(prompt: str, text: str) -> list[Token]:
    pipeline: Any = _Prompting(prompt)
    texts = asyncio.run(
        tokenize(pipeline, [text], truncate=False, prompt_name="p", add_special_tokens=False, render=lambda t: t)
    )
    return texts[0]


def test_a_token_the_prompt_and_the_text_share_shows_the_texts_part() -> None:
    """A prompt that does not end a word ("pre") joins the text's first word in one token ("prefix"): its
    offsets point into the text sent, and its `text` is those characters, as every token's with offsets is
    (it was "prefix" with start 0 and stop 3)."""
    tokens = _tokens("pre", "fix view")
    assert [t["id"] for t in tokens][:1] == [17576]  # "prefix", one token of the vocabulary
    assert (tokens[0]["text"], tokens[0]["start"], tokens[0]["stop"]) == ("fix", 0, 3)
    for t in tokens:
        assert t["text"] == "fix view"[t["start"] : t["stop"]]
    # a prompt that ends a word keeps its own tokens, without offsets, showing its characters
    spaced = _tokens("pre ", "fix")
    assert [(t["text"], t["start"], t["stop"]) for t in spaced] == [("pre", None, None), ("fix", 0, 3)]
