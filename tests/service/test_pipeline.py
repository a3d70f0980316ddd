"""The pipeline alone: where a request's texts are tokenised."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from mhaserve.runtime.errors import InvalidArgument
from mhaserve.runtime.repository import ModelRepository
from mhaserve.service.batching import Batcher
from mhaserve.service.batching.limits import CPU_LIMITS
from mhaserve.service.metrics import Metrics, ModelMetrics
from mhaserve.service.pipeline import (
    INLINE_TOKENIZE_CHARS,
    PREFIX_CHARS_PER_TOKEN,
    PREFIX_GROWTH,
    EncodeInput,
    Pipeline,
    _suffix,
    cutting_start,
    encode_long,
    word_edges,
)
from mhaserve.testing.engines import ScriptedEngine
from mhaserve.testing.loopback import WAIT


class RecordingPool(ThreadPoolExecutor):
    """A tokeniser pool that notes the name of every function handed to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="tokenize")
        self.names: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.names.append(fn.__name__)
        return super().submit(fn, *args, **kwargs)


def test_short_requests_are_tokenised_on_the_loop_and_long_ones_by_encode_batch_on_the_pool(tiny_repo: Path) -> None:
    """`Tokenizer.encode` holds the GIL, so a thread would run it beside nothing: a request's texts up to
    INLINE_TOKENIZE_CHARS in all are tokenised on the loop. Longer requests go to the pool through
    `encode_batch`, which lets go of the GIL (one long text too). Either way, the tokenizer's own ids."""
    repository = ModelRepository(tiny_repo)
    engine = ScriptedEngine()
    model = repository.load(repository.entry(), engine.factory())
    metrics = ModelMetrics(Metrics(), "m", 1)
    pool = RecordingPool()
    pipeline = Pipeline(model, Batcher(model.engine, limits=CPU_LIMITS), CPU_LIMITS, metrics, tokenize_pool=pool)
    word = "token "
    requests = {
        "one short text": ["a short query"],
        "several texts, the limit in all": [word * (INLINE_TOKENIZE_CHARS // len(word) // 4)] * 4,
        "one long text": [word * (INLINE_TOKENIZE_CHARS // len(word) + 1)],
        "several texts, over the limit in all": [word * 60] * 3,
    }
    assert sum(map(len, requests["several texts, the limit in all"])) <= INLINE_TOKENIZE_CHARS
    assert all(sum(map(len, requests[k])) > INLINE_TOKENIZE_CHARS for k in list(requests)[2:])

    async def tokenise_each() -> list[str]:
        handed: list[str] = []
        for name, texts in requests.items():
            before = len(pool.names)
            got = await asyncio.wait_for(pipeline.tokenize(texts, truncate=True), WAIT)
            assert [e.ids for e in got] == [model.tokenizer.encode(t).ids for t in texts], name
            handed += [name] * (len(pool.names) - before)
        return handed

    try:
        handed = asyncio.run(tokenise_each())
    finally:
        pipeline.close()
        pool.shutdown()
    assert handed == ["one long text", "several texts, over the limit in all"]
    assert pool.names == ["_tokenize_long", "_tokenize_long"]


def test_a_long_text_refused_for_its_length_is_measured_on_the_pool_not_the_loop(tiny_repo: Path) -> None:
    """The refusal names the text's untruncated length, which takes a second tokenisation without truncation.
    For a long text that is the tokeniser's time again (seconds for the 4 MB a body may hold): on the pool,
    as the first one, so that the loop goes on serving meanwhile. A short one is measured on the loop."""
    repository = ModelRepository(tiny_repo)
    engine = ScriptedEngine()
    model = repository.load(repository.entry(), engine.factory())
    pool = RecordingPool()
    pipeline = Pipeline(
        model, Batcher(model.engine, limits=CPU_LIMITS), CPU_LIMITS, ModelMetrics(Metrics(), "m", 1), tokenize_pool=pool
    )
    word = "token "
    long, short = word * (INLINE_TOKENIZE_CHARS // len(word) + 1), "a " * 300
    assert len(short) <= INLINE_TOKENIZE_CHARS < len(long)

    async def refusal(text: str) -> str:
        try:
            await asyncio.wait_for(pipeline.tokenize([text], truncate=False), WAIT)
        except InvalidArgument as e:
            assert e.param == "input"
            return e.message
        raise AssertionError("not refused")

    try:
        messages = [asyncio.run(refusal(text)) for text in (long, short)]
    finally:
        pipeline.close()
        pool.shutdown()
    untruncated = Tokenizer.from_str(model.tokenizer.to_str())
    untruncated.no_truncation()
    for message, text in zip(messages, (long, short), strict=True):
        assert f"input 0 is {len(untruncated.encode(text).ids)} tokens long" in message
    # the long text: tokenised, then measured by a copy of the tokenizer that does not truncate, made once on
    # the pool too (from the tokenizer's JSON: tens of milliseconds, once spent on the loop)
    assert pool.names == ["_tokenize_long", "untruncated", "encode_batch"]


def _minilm_tokenizer() -> Tokenizer:
    from mhaserve.model.checkpoint import default_source
    from mhaserve.runtime.tokenizer import load_for_serving

    return load_for_serving(default_source() / "tokenizer.json", 256)


class Counting:
    """A tokenizer that counts the characters it is given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.chars = tokenizer, 0

    def encode_batch(self, texts: list[str]) -> Any:
        self.chars += sum(map(len, texts))
        return self.tokenizer.encode_batch(texts)

    def encode(self, text: str) -> Any:
        self.chars += len(text)
        return self.tokenizer.encode(text)


@pytest.mark.parametrize("cut_start", [False, True], ids=["end cut", "start cut"])
def test_a_long_text_is_tokenised_from_the_end_it_keeps_with_the_same_ids_as_in_full(cut_start: bool) -> None:
    """A 4 MB text cost seconds of the tokeniser and a gigabyte for the 256 tokens it is cut to. Cut before a
    whitespace, a start that already fills the maximum gives the whole text's truncated ids, to the last one;
    texts whose start does not (whitespace runs, no whitespace at all) are tokenised in full as before. The
    mirror for a tokenizer that cuts a text's start (truncation_direction left; `_suffix`): the same texts
    reversed, whose ends are the others' starts."""
    tokenizer = cutting_start(_minilm_tokenizer(), 256) if cut_start else _minilm_tokenizer()
    edges = word_edges(tokenizer)
    limit = 256 * PREFIX_CHARS_PER_TOKEN
    prose = " ".join(Path("loadtest/corpus.txt").read_text().split()[:3000])
    japanese = "東京都の天気は晴れです。明日は雨が降るでしょう、傘を持って行ってください。"
    record = '{"id":12345,"name":"Ça Déjà-vu","tags":["a","b"],"score":0.75,"note":"naïve_café"}'
    texts = {
        "prose": prose * 20,
        "accents and case": "Ça Déjà-vu, NAÏVE café! " * 2000,
        "newlines and tabs": "first line\n\tsecond\r\nthird " * 3000,
        "whitespace runs": "word" + " " * (2 * limit) + "tail " * 100,
        "no whitespace": "a" * (3 * limit) + " then words",
        "cjk": "中文字符测试" * 5000,
        "a long word first": "x" * 500 + " " + prose,
        "exactly at the limit": ("ab " * limit)[:limit],
        "short": "a short query",
        # no whitespace at all, but BERT's words end at its punctuation and CJK ideographs
        "japanese": japanese * 2000,
        "japanese after one space": "x " + japanese * 2000,
        "minified json": "[" + ",".join([record] * 2000) + "]",
        "base64": "QmFzZTY0IGlzIGEgZ3JvdXAgb2YgYmluYXJ5LXRvLXRleHQ+/ZW5jb2Rpbmc=" * 2000,
        "kana alone": "あいうえおかきくけこ" * 2000,  # no edge: one word, tokenised whole
        "kana and its punctuation": "あいうえお、かきくけこ。" * 4000,
        "accents on a mark's edge": "e\u0301!" * 8000,  # a combining accent never begins a cut
    }
    if cut_start:
        texts = {name: text[::-1] for name, text in texts.items()}
    part = _suffix if cut_start else None
    counting = Counting(tokenizer)
    got = encode_long(counting, list(texts.values()), limit, part, edges)  # type: ignore[arg-type]
    want = tokenizer.encode_batch(list(texts.values()))
    for name, g, w in zip(texts, got, want, strict=True):
        assert g.ids == w.ids and bool(g.overflowing) == bool(w.overflowing), name
    # the prose and the like were read from the end they keep only, texts without whitespace too
    for name in (
        "prose",
        "japanese",
        "japanese after one space",
        "minified json",
        "base64",
        "kana and its punctuation",
    ):
        counting.chars = 0
        long = texts[name] * 20
        encode_long(counting, [long], limit, part, edges)  # type: ignore[arg-type]
        assert counting.chars <= limit < len(long) // 100, name


@pytest.mark.parametrize("cut_start", [False, True], ids=["end cut", "start cut"])
@pytest.mark.parametrize("word", [8_000, 9_000], ids=["a long word first", "no edge within the first part"])
def test_a_long_text_whose_first_part_does_not_fill_the_model_is_read_further_not_whole(
    cut_start: bool, word: int
) -> None:
    """A reviewer's 4 MB text: one word of 8,000 characters (one [UNK]), then short words. Its start up to the
    prefix bound is a few dozen tokens, and the whole 4 MB was tokenised (10 s of a tokeniser thread, shared by
    every model, and up to a gigabyte); a part four times longer fills the model. With no edge at all within the
    first part (9,000 characters), it was tokenised whole too. The mirror for a start cut: the text reversed."""
    tokenizer = cutting_start(_minilm_tokenizer(), 256) if cut_start else _minilm_tokenizer()
    edges = word_edges(tokenizer)
    limit = 256 * PREFIX_CHARS_PER_TOKEN
    text = "y" * word + " ab" * 1_400_000
    if cut_start:
        text = text[::-1]
    counting = Counting(tokenizer)
    got = encode_long(counting, [text], limit, _suffix if cut_start else None, edges)  # type: ignore[arg-type]
    assert len(got[0].ids) == 256 and got[0].overflowing
    # the first part (or none, without an edge in it), then one four times longer
    assert counting.chars <= 5 * limit < len(text) // 100


@pytest.mark.parametrize("cut_start", [False, True], ids=["end cut", "start cut"])
def test_a_part_read_further_has_the_whole_texts_ids(cut_start: bool) -> None:
    """Where the first part does not fill the model, longer ones are read, each cut before a word's edge too: the
    ids of the whole text to the last one, each text of a batch alone (some filled at once, some after one or
    several longer parts, some whole), and (for the end cut) a cut through an added token avoided at a longer part's
    end too."""
    tokenizer = cutting_start(_minilm_tokenizer(), 256) if cut_start else _minilm_tokenizer()
    edges = word_edges(tokenizer)
    limit = 256 * PREFIX_CHARS_PER_TOKEN
    # 252 words and a long one (254 tokens with [CLS] and [SEP]), then an added token whose `]` ends the second part:
    # cut through, `[` and `mask` would overflow the maximum
    mask = "hello " * 252 + "y" * (4 * limit - 1512 - 7) + " [MASK]"
    texts = {
        "a long word first": "y" * 8_000 + " ab" * 20_000,
        "no edge in the first part": "y" * 9_000 + " ab" * 20_000,
        "a long word after a few": "ab " * 10 + "y" * 50_000 + " ab" * 60_000,
        "fills at once": "ab " * 20_000,
        "words, then a long one": "hello " * 250 + "y" * limit + " ab" * 5_000,
        "a whitespace run past the second part": "word" + " " * (5 * limit) + "tail " * 3_000,
        "a whitespace run, then a long word": " " * (2 * limit) + "y" * (8 * limit) + " word" * 3_000,
        "whole at the second part": "y" * 8_000 + " ab" * 100,
        "an added token at the second part's end": mask + " world" * 3_000,
        "short": "a short query",
        "no edge at all": "y" * (20 * limit),
    }
    assert texts["an added token at the second part's end"].index("[MASK]") == 4 * limit - 6
    if cut_start:
        texts = {name: text[::-1].replace("]KSAM[", "[MASK]") for name, text in texts.items()}
    got = encode_long(tokenizer, list(texts.values()), limit, _suffix if cut_start else None, edges)
    want = tokenizer.encode_batch(list(texts.values()))
    for name, g, w in zip(texts, got, want, strict=True):
        assert g.ids == w.ids and bool(g.overflowing) == bool(w.overflowing), name


def test_only_whitespace_is_a_words_edge_for_tokenizers_other_than_berts() -> None:
    """A byte-level BPE groups a run of punctuation marks into one token, and other normalisers may join characters
    across one: their long texts are cut at whitespace only, BERT's also at ASCII punctuation and CJK ideographs
    (where its own normaliser does not keep those together: `handle_chinese_chars` false)."""
    from tokenizers import models, normalizers, pre_tokenizers

    bert = _minilm_tokenizer()
    assert (
        word_edges(bert).edge.search("a,b")
        and word_edges(bert).edge.search("中")
        and word_edges(bert).edge.search("、")
    )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert word_edges(bpe).edge.pattern == "[ \n\t\r]"
    bert.normalizer = normalizers.BertNormalizer(handle_chinese_chars=False)
    assert word_edges(bert).edge.search("a,b") and not word_edges(bert).edge.search("中")
    bert.normalizer = normalizers.NFKC()
    assert not word_edges(bert).edge.search("a,b中、")


@pytest.mark.parametrize("cut_start", [False, True], ids=["end cut", "start cut"])
@pytest.mark.parametrize("token", ["[MASK]", "[SEP]", "[mask]"])
def test_a_cut_never_goes_through_an_added_token(cut_start: bool, token: str) -> None:
    """The tokenizer finds its added tokens in the raw text first: a cut at the `]` of a `[MASK]` whose start fills
    the maximum to its last token gave `[` where the whole text has `[MASK]` (a review's finding). 253 one-token
    words, then the token ending right at the limit (for a start cut, the mirror), then more words."""
    tokenizer = cutting_start(_minilm_tokenizer(), 256) if cut_start else _minilm_tokenizer()
    edges = word_edges(tokenizer)
    limit = 256 * PREFIX_CHARS_PER_TOKEN
    body = ("hello" + " " * 27) * 253
    head = body + " " * (limit - len(token) - len(body)) + token
    text = head + " world" * 3000
    if cut_start:
        text = text[::-1].replace(token[::-1], token)
    got = encode_long(tokenizer, [text], limit, _suffix if cut_start else None, edges)[0]
    want = tokenizer.encode_batch([text])[0]
    assert got.tokens == want.tokens


def test_a_very_long_text_refused_for_its_length_is_measured_from_its_start(tiny_repo: Path) -> None:
    repository = ModelRepository(tiny_repo)
    model = repository.load(repository.entry(), ScriptedEngine().factory())
    pipeline = Pipeline(model, Batcher(model.engine, limits=CPU_LIMITS), CPU_LIMITS, ModelMetrics(Metrics(), "m", 1))
    text = "token " * 1_000_000
    limit = pipeline.max_tokens * PREFIX_CHARS_PER_TOKEN
    # its start all whitespace: that start alone is a few tokens, which was said as "longer than 2 tokens"
    spaced = " " * (limit + 10) + "token " * 1_000
    # no word edge in its start: it was measured whole (4 MB: seconds of the tokeniser, for a refusal)
    worded = "y" * (limit + 10) + " token" * 700_000

    async def refusal(text: str) -> str:
        try:
            await asyncio.wait_for(pipeline.tokenize([text], truncate=False), WAIT)
        except InvalidArgument as e:
            return e.message
        raise AssertionError("not refused")

    whole = asyncio.run(pipeline._whole_tokenizer())
    counting = Counting(whole)
    pipeline._untruncated = counting  # type: ignore[assignment]
    try:
        messages = [asyncio.run(refusal(t)) for t in (text, spaced, worded)]
    finally:
        pipeline.close()
    # each measured from a start that alone is past the maximum, read further where a start is not (the spaced
    # one, 11 kB, then whole)
    for message in (messages[0], messages[2]):
        m = re.search(r"input 0 is longer than (\d+) tokens \(its first (\d+) characters alone\)", message)
        assert m is not None, message
        assert int(m[1]) > pipeline.max_tokens and int(m[2]) <= limit * PREFIX_GROWTH, message
    assert messages[1].startswith("input 0 is 5002 tokens long, more than the model's maximum"), messages[1]
    assert counting.chars < 5 * limit * PREFIX_GROWTH  # never the whole of the 4 MB


def test_token_ids_cut_to_the_maximum_keep_their_closing_special_token_as_a_text_truncated_does(
    minilm_entry: Path,
) -> None:
    """A client that tokenised a long text itself ([CLS] ... [SEP]) and asks to truncate reads the same ids, so
    the same vector, as if it had sent the text with truncate; ids without the closing [SEP] keep their start."""
    repository = ModelRepository(minilm_entry.parent.parent)
    model = repository.load(repository.entry(), ScriptedEngine().factory())
    pipeline = Pipeline(model, Batcher(model.engine, limits=CPU_LIMITS), CPU_LIMITS, ModelMetrics(Metrics(), "m", 1))
    untruncated = Tokenizer.from_str(model.tokenizer.to_str())
    untruncated.no_truncation()
    text = "a sentence of several words, repeated until it is long enough. " * 60
    full = untruncated.encode(text).ids
    bare = untruncated.encode(text, add_special_tokens=False).ids
    assert len(bare) > pipeline.max_tokens and full[-1] == model.tokenizer.token_to_id("[SEP]")

    async def ids(req: EncodeInput) -> list[list[int]]:
        return [seq.tolist() for seq in await asyncio.wait_for(pipeline.encode_pre(req), WAIT)]

    async def main() -> tuple[list[list[int]], ...]:
        # an id outside the vocabulary in the part truncate drops is still refused (once served as it was cut)
        past_the_cut = [*full[:300], 99_999, *full[300:]]
        with pytest.raises(InvalidArgument, match="token id 99999, outside the vocabulary"):
            await ids(EncodeInput(token_ids=[past_the_cut], truncate=True))
        return (
            await ids(EncodeInput(texts=[text], truncate=True)),
            await ids(EncodeInput(token_ids=[full], truncate=True)),
            await ids(EncodeInput(token_ids=[bare], truncate=True)),
        )

    try:
        from_text, from_ids, from_bare = asyncio.run(main())
    finally:
        pipeline.close()
    assert from_ids == from_text == [model.tokenizer.encode(text).ids]
    assert len(from_text[0]) == pipeline.max_tokens
    assert from_bare == [bare[: pipeline.max_tokens]]


def test_a_requests_own_truncate_wins_over_the_servers(tiny_repo: Path) -> None:
    """A request's truncate, true or false, is what it says; only an unset one (None) is the server's
    --auto-truncate, as text-embeddings-inference reads `truncate.unwrap_or(auto_truncate)`: an explicit false
    was cut by --auto-truncate, silently, where TEI refuses the input."""
    repository = ModelRepository(tiny_repo)
    model = repository.load(repository.entry(), ScriptedEngine().factory())
    limit = model.entry.max_tokens
    text, token_ids = "a " * limit, [7] * (limit + 1)

    async def lengths(pipeline: Pipeline, truncate: bool | None) -> list[int] | str:
        asked = (EncodeInput(texts=[text], truncate=truncate), EncodeInput(token_ids=[token_ids], truncate=truncate))
        try:
            return [len(seq) for req in asked for seq in await asyncio.wait_for(pipeline.encode_pre(req), WAIT)]
        except InvalidArgument as e:
            return e.message

    for auto in (True, False):
        batcher, metrics = Batcher(model.engine, limits=CPU_LIMITS), ModelMetrics(Metrics(), "m", 1)
        pipeline = Pipeline(model, batcher, CPU_LIMITS, metrics, auto_truncate=auto)
        try:
            got = {truncate: asyncio.run(lengths(pipeline, truncate)) for truncate in (True, False, None)}
        finally:
            pipeline.close()
        assert got[True] == [limit, limit], auto
        assert f"input 0 is {limit + 2} tokens long" in str(got[False]), auto
        assert got[None] == (got[True] if auto else got[False]), auto


def test_cutting_a_long_inputs_start_keeps_its_end_and_its_special_tokens(tiny_repo: Path) -> None:
    """truncate_start (TEI's truncation_direction left): a text is cut as the tokenizer cuts it from the left, a long
    one on the pool (no prefix of it will do: its end is kept); token ids keep the opening and closing special
    tokens they have and the last of the rest, ids without them just the last."""
    repository = ModelRepository(tiny_repo)
    model = repository.load(repository.entry(), ScriptedEngine().factory())
    pool = RecordingPool()
    pipeline = Pipeline(
        model, Batcher(model.engine, limits=CPU_LIMITS), CPU_LIMITS, ModelMetrics(Metrics(), "m", 1), tokenize_pool=pool
    )
    keep = pipeline.max_tokens
    reference = Tokenizer.from_str(model.tokenizer.to_str())
    reference.enable_truncation(keep, direction="left")
    short, long = "tail " * 50 + "the end", "head " * INLINE_TOKENIZE_CHARS + "the very end"

    async def cut() -> tuple[list[list[int]], list[list[int]]]:
        texts = [
            (await pipeline.encode_pre(EncodeInput(texts=[t], truncate=True, truncate_start=True)))[0].tolist()
            for t in (short, long)
        ]
        whole = model.tokenizer.encode(short, add_special_tokens=False).ids * 4  # no special tokens
        framed = [2, *whole, 3]
        ids = await pipeline.encode_pre(EncodeInput(token_ids=[framed, whole], truncate=True, truncate_start=True))
        return texts, [a.tolist() for a in ids]

    try:
        texts, ids = asyncio.run(cut())
    finally:
        pipeline.close()
        pool.shutdown()
    assert texts == [reference.encode(short).ids, reference.encode(long).ids]
    assert all(len(t) == keep for t in texts) and texts[0] != model.tokenizer.encode(short).ids
    assert pool.names == ["cutting_start", "encode_long"]  # the copy, made once; the long text from its end
    whole = model.tokenizer.encode(short, add_special_tokens=False).ids * 4
    assert ids == [[2, *whole[-(keep - 2) :], 3], whole[-keep:]]
