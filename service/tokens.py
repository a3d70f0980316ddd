"""A text's tokens as the model sees them, for every API that shows them: text-embeddings-inference's
`POST /tokenize` (service/utility.py) and its gRPC `tei.v1.Tokenize/Tokenize` (service/tei_v1.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Annotated, TypeVar

from pydantic import Field
from tokenizers import Encoding
from typing_extensions import TypedDict

from mhaserve.runtime.errors import InvalidArgument
from mhaserve.service.pipeline import EncodeInput, Pipeline

R = TypeVar("R")


# The tokens one answer holds at most (a 400 past them): each is a Python dict until the answer is encoded, about
# 700 bytes, so one 4 MB request within every other limit (2,000 texts of 1,000 words: 2 million tokens) took 1.45 GB
# more memory at its peak, and a few at once a container's 4 GB. 262,144 is about 190 MB; 1,024 texts of 256 tokens.
MAX_TOKENIZE_TOKENS = 262_144
# A request's tokens up to this many are made into its answer where it is asked, on the event loop: about 0.4 ms
# (0.8 us a token, its dict and its JSON); more, on the tokeniser threads (see `tokenize`).
INLINE_TOKENS = 512


# One token of a text; also `POST /tokenize`'s answer schema. A dict rather than a dataclass: 1.2 million of them
# (one request within every limit) took 2.7 s to make as frozen dataclasses, 0.8 s as dicts, and orjson encodes
# a dict as it is.
class Token(TypedDict):
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
    render: Callable[[list[list[Token]]], R],
    truncatable: bool = True,
) -> R:
    """Each text's tokens, as text-embeddings-inference's /tokenize gives them, made into the answer by `render`
    (JSON, or protobuf messages): every token of the text, its `text` the text's own characters (not the
    vocabulary's `##ing`), or with `truncate` the tokens the model sees (cut at its maximum). A text longer than
    `Pipeline.tokenize_whole` takes is refused without `truncate` (the refusal says to set it unless the API
    has none: not `truncatable`). `add_special_tokens` false leaves [CLS] and [SEP] out of the answer. Errors
    name `inputs`, both APIs' field.

    An answer of many tokens is made on the tokeniser threads: a Python object a token, made on the event loop,
    held every other client (health probes included) for 15 to 20 seconds for one request of 1.2 million tokens
    within every limit (a review's finding). There it holds the GIL, which the loop still gets every few
    milliseconds."""
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
            else pipeline.tokenize_whole(prompted, prompted=bool(pipeline.prompt(asked)), truncatable=truncatable)
        )
    except InvalidArgument as e:
        if e.param == "input":  # the pipeline's checks name the embeddings APIs' field
            raise InvalidArgument(e.message, param="inputs") from None
        raise
    if (total := sum(map(len, encodings))) > MAX_TOKENIZE_TOKENS:
        raise InvalidArgument(
            f"the answer would hold {total} tokens; one tokenize request answers at most {MAX_TOKENIZE_TOKENS}: "
            "send fewer or shorter inputs, or truncate",
            param="inputs",
        )
    # Offsets count in the text sent: the prompt put before it (the same for every text) is not in it.
    shift = len(prompted[0]) - len(texts[0])
    work = functools.partial(answer, prompted, encodings, shift, add_special_tokens, render)
    if sum(map(len, encodings)) <= INLINE_TOKENS:
        return work()
    return await pipeline.off_loop(work)


def answer(
    prompted: Sequence[str],
    encodings: Sequence[Encoding],
    shift: int,
    add_special_tokens: bool,
    render: Callable[[list[list[Token]]], R],
) -> R:
    """`tokenize`'s answer, from each prompted text's encoding; `shift` is the prompt's length. A token the prompt
    and the text share ("pre" + "fix...": "prefix") has the text's part as its offsets and `text`."""
    return render(
        [
            [
                {
                    "id": token_id,
                    "text": token if special else text[start if stop <= shift else max(start, shift) : stop],
                    "special": bool(special),
                    "start": None if special or stop <= shift else max(start - shift, 0),
                    "stop": None if special or stop <= shift else stop - shift,
                }
                for token_id, token, special, (start, stop) in zip(
                    enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets, strict=True
                )
                if add_special_tokens or not special
            ]
            for text, enc in zip(prompted, encodings, strict=True)
        ]
    )
