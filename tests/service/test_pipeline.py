"""The pipeline alone: where a request's texts are tokenised."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from mhaserve.runtime.errors import InvalidArgument
from mhaserve.runtime.repository import ModelRepository
from mhaserve.service.batching import Batcher
from mhaserve.service.batching.limits import CPU_LIMITS
from mhaserve.service.metrics import Metrics, ModelMetrics
from mhaserve.service.pipeline import INLINE_TOKENIZE_CHARS, Pipeline
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
    assert pool.names == ["encode_batch", "encode_batch"]


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
    assert pool.names == ["encode_batch", "encode_batch"]  # the long text: tokenised, then measured
