"""A text's tokens as the model sees them, for every API that shows them: text-embeddings-inference's
`POST /tokenize` (service/utility.py) and its gRPC `tei.v1.Tokenize/Tokenize` (service/tei_v1.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from mhaserve.runtime.errors import InvalidArgument
from mhaserve.service.pipeline import EncodeInput, Pipeline


# One token of a text; also `POST /tokenize`'s answer schema, as FastAPI reads a dataclass (with no docstring,
# which would become the schema's description).
@dataclass(frozen=True)
class Token:
    id: int
    text: Annotated[
        str, Field(description="the input's characters start to stop; a special token's or the prompt's own text")
    ]
    special: bool
    start: Annotated[
        int | None,
        Field(
            description="character offset in the input (text-embeddings-inference's are UTF-8 byte offsets, the "
            "same for ASCII); null for special tokens and for the prompt's tokens"
        ),
    ]
    stop: int | None


async def tokenize(
    pipeline: Pipeline,
    texts: Sequence[str],
    *,
    truncate: bool,
    prompt_name: str | None,
    add_special_tokens: bool,
) -> list[list[Token]]:
    """Each text's tokens, as text-embeddings-inference's /tokenize gives them: every token of the text, its
    `text` the text's own characters (not the vocabulary's `##ing`), or with `truncate` the tokens the model
    sees (cut at its maximum). A text longer than `Pipeline.tokenize_whole` takes is refused without
    `truncate`. `add_special_tokens` false leaves [CLS] and [SEP] out of the answer. Errors name `inputs`,
    both APIs' field."""
    if not texts:
        raise InvalidArgument("inputs is empty: send a text or a list of texts", param="inputs")
    asked = EncodeInput(texts=texts, truncate=truncate, prompt_name=prompt_name)
    try:
        pipeline.validate(asked)  # the prompt named among them: before it is put in
        prompted = pipeline.prompted(asked)
        # (refused past the model's maximum once, as an embedding is: no way to learn how long a document is)
        encodings = await (
            pipeline.tokenize(prompted, truncate=True)
            if truncate
            else pipeline.tokenize_whole(prompted, prompted=bool(pipeline.prompt(asked)))
        )
    except InvalidArgument as e:
        if e.param == "input":  # the pipeline's checks name the embeddings APIs' field
            raise InvalidArgument(e.message, param="inputs") from None
        raise
    # Offsets count in the text sent: the prompt put before it (the same for every text) is not in it. A token
    # the prompt and the text share ("pre" + "fix...": "prefix") has the text's part as its offsets and `text`.
    shift = len(prompted[0]) - len(texts[0])
    return [
        [
            Token(
                id=token_id,
                text=token if special else text[start if stop <= shift else max(start, shift) : stop],
                special=bool(special),
                start=None if special or stop <= shift else max(start - shift, 0),
                stop=None if special or stop <= shift else stop - shift,
            )
            for token_id, token, special, (start, stop) in zip(
                enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets, strict=True
            )
            if add_special_tokens or not special
        ]
        for text, enc in zip(prompted, encodings, strict=True)
    ]
