"""One internal request type and the stages every API shares: encode_pre -> batcher -> encode_post.

Each protocol adapter (encoder.v1, the Open Inference Protocol, ...) converts its messages into
`EncodeInput` at its boundary and `EncodeOutput` back; validation, tokenisation, limits and
normalisation live here once, so the APIs cannot drift apart. One Pipeline serves one model version;
the data plane (dataplane.py) finds the one a request names.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

import numpy as np
import numpy.typing as npt
from tokenizers import Encoding, Tokenizer, normalizers, pre_tokenizers

from mhaserve.runtime.errors import InvalidArgument, Unavailable
from mhaserve.runtime.repository import LoadedModel
from mhaserve.service.batching import Batcher, Embeddings, Ids, Limits, Spent, Ticket
from mhaserve.service.context import request_id
from mhaserve.service.errors import status_name
from mhaserve.service.metrics import ModelMetrics
from mhaserve.service.stats import ModelStats

T = TypeVar("T")

# Texts of a request up to this many characters together are tokenised on the event loop (see tokenize):
# about 0.5 ms of the tokeniser at most (0.45 us a character here).
INLINE_TOKENIZE_CHARS = 1024
# The threads that tokenise longer requests (every model's, in the server), beside the event loop.
TOKENIZE_THREADS = 2
# A text longer than this many characters a token the model takes is first tokenised from its start only
# (see `_prefix`): a 4 MB text cost seconds of the tokeniser and a gigabyte of memory for 256 tokens.
PREFIX_CHARS_PER_TOKEN = 32
# Where that start does not fill the model (a long word first: one [UNK] for 8,000 characters), a part this many
# times longer is tried, and so on (see `encode_long`): the whole text only once a part would reach its length.
PREFIX_GROWTH = 4
# /tokenize without truncate tokenises a text whole up to this many characters a token the model takes, and
# refuses a longer one: text-embeddings-inference's limit (its MAX_CHAR_MULTIPLIER).
TOKENIZE_CHARS_PER_TOKEN = 250
# Token ids of a /decode request up to this many together are decoded on the event loop: about 0.25 ms of the
# tokenizer at most (1 us an id here).
INLINE_DECODE_IDS = 256


@dataclass(frozen=True)
class EncodeInput:
    """What a client asks for, whatever API it used. Exactly one of `texts` and `token_ids` is set."""

    texts: Sequence[str] = ()
    token_ids: Sequence[Sequence[int] | npt.NDArray[np.int64]] = ()
    model: str = ""  # empty: the default model
    version: int | str | None = None  # None or "": the latest served version (KServe sends versions as text)
    # Cut an input past the model's maximum (True) or refuse it (False); None: the server's --auto-truncate. A
    # request's own choice wins, as text-embeddings-inference reads `truncate.unwrap_or(auto_truncate)`.
    truncate: bool | None = None
    normalize: bool | None = None  # None: the model's default
    # Keep the first `dimensions` values and L2-normalise them (Matryoshka-trained models), unless the answer
    # is not normalised (`normalize` false, or the model's default); None: all.
    dimensions: int | None = None
    # A prompt of the model's serving config, put before each text; None: the model's default prompt.
    prompt_name: str | None = None
    # Where a long input is cut: its end (False: its start is kept, as sentence-transformers and every API's default
    # do) or its start (True: its end is kept, text-embeddings-inference's truncation_direction left).
    truncate_start: bool = False


@dataclass(frozen=True)
class EncodeOutput:
    """One embedding per input, in input order."""

    embeddings: Embeddings  # (n, d) float32
    model: str
    version: int
    input_tokens: int
    # Where the request's time went in the pipeline, in nanoseconds (what TEI's API reports a request): until it
    # was queued (validation and tokenisation), then in the queue, then in the model (Spent).
    tokenization_ns: int = 0
    queue_ns: int = 0
    inference_ns: int = 0


def l2_normalize(x: Embeddings) -> Embeddings:
    # The same epsilon as torch.nn.functional.normalize, so an all-zero row stays zero as it does there.
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)


class Pipeline:
    """Validates and tokenises requests, queues them on the batcher, post-processes the embeddings."""

    def __init__(
        self,
        model: LoadedModel,
        batcher: Batcher,
        limits: Limits,
        metrics: ModelMetrics,
        *,
        auto_truncate: bool = False,
        tokenize_pool: ThreadPoolExecutor | None = None,
    ) -> None:
        self.model = model
        self.batcher = batcher
        self.limits = limits
        self.metrics = metrics
        self.auto_truncate = auto_truncate  # --auto-truncate: what a request that does not say truncate gets
        # per-model statistics for both APIs (the v2 ModelStatistics), shared with the version's other copies
        self.stats = metrics.shared("stats", functools.partial(ModelStats, metrics))
        self.max_tokens = model.entry.max_tokens
        self.vocab_size = model.entry.manifest.vocab_size
        self.dimensions = model.entry.manifest.hidden_size
        self.prompts = model.entry.prompts
        self.default_prompt = model.entry.default_prompt_name
        # The model's version policy in force: the manager sets it when serving.json's policy alone changes
        # (which reloads no version, so the entry keeps the policy it was loaded under).
        self.version_policy = model.entry.config.version_policy
        # Long texts are tokenised off the event loop. tokenizers releases the GIL and parallelises a batch
        # itself, so two threads are enough to overlap requests; the server shares its two among every model.
        self._own_pool = tokenize_pool is None
        self._tokenize_pool = tokenize_pool or ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self._edges = word_edges(model.tokenizer)  # where a long text may be cut before it is tokenised
        self._untruncated: Tokenizer | None = None
        self._start_cutting: Tokenizer | None = None  # the tokenizer cutting a long text's start (truncate_start)
        # The special tokens the tokenizer ends each text with ([SEP], RoBERTa's </s>): token ids cut to the
        # maximum keep them, as the tokenizer's own truncation of a text does (the same ids, the same vector).
        self._tail = special_tail(model.tokenizer)
        self._head = special_head(model.tokenizer)  # [CLS], <s>: what ids cut at their start keep first
        # Requests between encode()'s start and its end (queued ones included), and those answered in parts
        # that hold this version (`held`): a retired version waits for none before it closes; `quiet` is set
        # whenever there are none.
        self.active = 0
        self.quiet = asyncio.Event()
        self.quiet.set()
        self.closed = False
        # Set by the model manager once a retired version holds no request: what one that comes after is told.
        self.retired: str | None = None

    def close(self) -> None:
        self.closed = True
        if self._own_pool:
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """This version kept open while the block runs, retired or not: a request answered in parts (a JSON
        Lines body's lines) holds the version it was resolved to, so that its parts after the first are not
        refused by a version that closed between them (it closes once no request is in it)."""
        if self.retired is not None:
            raise Unavailable(self.retired)
        if self.closed:
            raise Unavailable(f"{self.model.name} version {self.model.version} was unloaded; retry")
        self.active += 1
        self.quiet.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self.quiet.set()

    async def encode(self, req: EncodeInput, *, time_left: float | None = None) -> EncodeOutput:
        """The whole pipeline for one request; `time_left` is the seconds until the client's deadline."""
        with self.held():
            return await self._encode(req, time_left)

    async def _encode(self, req: EncodeInput, time_left: float | None) -> EncodeOutput:
        loop = asyncio.get_running_loop()
        deadline = None if time_left is None else loop.time() + time_left
        t0 = time.perf_counter_ns()
        ticket: Ticket | None = None
        try:
            # Queue slots first: past the limit a request is refused before its (costly) tokenisation.
            self.validate(req)
            ticket = self.batcher.admit(len(req.texts) or len(req.token_ids))
            seqs = await self.encode_pre(req)
            t1 = time.perf_counter_ns()
            spent = Spent()
            embeddings = await self.batcher.submit(
                seqs, deadline=deadline, request_id=request_id.get(), ticket=ticket, spent=spent
            )
            t2 = time.perf_counter_ns()
            output = self.encode_post(req, seqs, embeddings, tokenization_ns=t1 - t0, spent=spent)
        except BaseException as e:  # cancellation included: the request failed either way
            # a cancellation at the call's deadline counts as DEADLINE_EXCEEDED, as the call's own status does
            self.refused(e, t0, time_left=None if deadline is None else deadline - loop.time())
            raise
        finally:
            if ticket is not None:
                self.batcher.release(ticket)  # what submit did not take (a failure before queueing)
        t3 = time.perf_counter_ns()
        self.stats.succeeded(
            inputs=len(seqs),
            total_ns=t3 - t0,
            input_ns=t1 - t0,
            queue_ns=output.queue_ns,
            infer_ns=output.inference_ns,
            output_ns=t3 - t2,
        )
        self.metrics.ended("OK")
        return output

    def refused(self, error: BaseException, started_ns: int, *, time_left: float | None = None) -> None:
        """A request for this version failed (`started_ns` from `time.perf_counter_ns`; `time_left` until its
        deadline, if it has one): in the statistics and the metrics alike, whether the pipeline refused it or
        its protocol's boundary did (a KServe tensor that does not decode)."""
        self.stats.failed(time.perf_counter_ns() - started_ns)
        self.metrics.ended(status_name(error, time_left))

    def validate(self, req: EncodeInput) -> None:
        """The checks that need no tokenisation: which inputs, how many."""
        if req.texts and req.token_ids:
            raise InvalidArgument("set either texts or token_ids, not both")
        n = len(req.texts) or len(req.token_ids)
        if n == 0:
            raise InvalidArgument("no inputs: set texts or token_ids")
        self.validate_count(n)
        if req.prompt_name and req.token_ids:
            raise InvalidArgument("prompt_name applies to texts; token ids are sent as they are", param="prompt_name")
        if req.prompt_name and req.prompt_name not in self.prompts:
            known = ", ".join(repr(p) for p in sorted(self.prompts))
            has = f"its prompts are {known}" if known else "it has none (serving.json can name some: docs/models.md)"
            raise InvalidArgument(
                f"model {self.model.name!r} has no prompt {req.prompt_name!r}: {has}", param="prompt_name"
            )
        if req.dimensions is not None and not 1 <= req.dimensions <= self.dimensions:
            raise InvalidArgument(
                f"dimensions is {req.dimensions}; this model's embeddings have {self.dimensions}: "
                f"ask for 1 to {self.dimensions}",
                param="dimensions",
            )

    def count_first(self, n: int) -> None:
        """Refuse a request of more inputs than this version takes before a protocol decodes them, which costs
        per input on the event loop: 500,000 token-id lists (a 4 MB gRPC message, a 3 MB JSON body) took
        0.6-2.5 s to become arrays or pass validation, and then were refused. In the statistics, as the
        pipeline's own refusals are."""
        started = time.perf_counter_ns()
        try:
            self.validate_count(n)
        except InvalidArgument as e:
            self.refused(e, started)
            raise

    def queue_share(self, inputs: int) -> float:
        """The part of half this version's queue a request of `inputs` takes: what one stream (or JSON Lines
        body) may fill at once (`streaming.ordered`), the other half left to other clients."""
        return inputs / max(1, self.limits.max_queue_size // 2)

    def validate_count(self, n: int) -> None:
        if n > self.limits.max_client_batch_size:
            raise InvalidArgument(
                f"{n} inputs in one request; the limit is {self.limits.max_client_batch_size} (split the request)",
                param="input",
            )

    @property
    def created(self) -> int:
        """When the served version was exported, in seconds since the epoch (0 if the manifest does not say)."""
        try:
            return int(datetime.fromisoformat(self.model.entry.manifest.created).timestamp())
        except ValueError:
            return 0

    async def tokenize(
        self, texts: Sequence[str], *, truncate: bool, prompted: bool = False, cut_start: bool = False
    ) -> list[Encoding]:
        """Tokenise texts; an input past the model's maximum is refused unless `truncate`, with a message that
        gives both lengths (and says the count includes a prompt where one is `prompted` before each text); one
        cut loses its end, or with `cut_start` its start (and a prompt before it first, as TEI cuts it).

        Short texts are tokenised right here, on the event loop. `Tokenizer.encode` holds the GIL while it
        works, so a thread would not run it beside the loop anyway: it would only add the hand-off there and
        back (about 0.2 ms each way on a 2-core VM) and make the loop wait for the GIL. Longer requests go
        to the tokeniser threads through `encode_batch`, which lets go of the GIL, so that no request holds
        the loop for long.
        """
        t0 = time.perf_counter()
        if cut_start and truncate:  # refused when long, the direction changes nothing: the usual way, and cheap
            encodings = await self._tokenize_cutting_start(texts)
        elif sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            encodings = self._tokenize(list(texts))
        else:
            loop = asyncio.get_running_loop()
            encodings = await loop.run_in_executor(self._tokenize_pool, self._tokenize_long, list(texts))
        self.metrics.tokenize.observe(time.perf_counter() - t0)
        if not truncate:
            for i, enc in enumerate(encodings):
                if enc.overflowing:
                    length, measured = await self._length(texts[i])
                    raise InvalidArgument(self._too_long(i, length, measured, prompted=prompted), param="input")
        return encodings

    async def tokenize_whole(
        self, texts: Sequence[str], *, prompted: bool = False, truncatable: bool = True
    ) -> list[Encoding]:
        """Every token of each text, none cut at the model's maximum (what /tokenize shows without `truncate`, as
        TEI's does: how long a document is, to split it); a text longer than `TOKENIZE_CHARS_PER_TOKEN`
        characters a token of that maximum is refused, as TEI refuses it (its count said to include the prompt
        where one is `prompted` before each text; the refusal tells to set truncate where the API has it,
        `truncatable`). Off the event loop past a few."""
        limit = self.max_tokens * TOKENIZE_CHARS_PER_TOKEN
        for i, text in enumerate(texts):
            if len(text) > limit:
                long = f"{len(text)} characters long{' (the prompt included)' if prompted else ''}"
                raise InvalidArgument(
                    f"input {i} is {long}; a text is tokenised whole up to {limit} "
                    f"({TOKENIZE_CHARS_PER_TOKEN} a token of the model's maximum, as text-embeddings-inference "
                    f"does): shorten it{' or set truncate' if truncatable else ''}",
                    param="input",
                )
        loop = asyncio.get_running_loop()
        whole = await self._whole_tokenizer()
        if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            return [whole.encode(text) for text in texts]
        return await loop.run_in_executor(self._tokenize_pool, whole.encode_batch, list(texts))

    async def decode(self, token_ids: Sequence[Sequence[int]], *, skip_special_tokens: bool) -> list[str]:
        """Token ids back to text, each list as the tokenizer decodes it; an id outside the vocabulary is
        refused, naming the list. Many ids are checked and decoded off the event loop, as long texts are
        tokenised."""
        decode = functools.partial(self._decode, token_ids, skip_special_tokens)
        if sum(map(len, token_ids)) <= INLINE_DECODE_IDS:
            return decode()
        return await self.off_loop(decode)

    async def off_loop(self, work: Callable[[], T]) -> T:
        """`work` on the tokeniser threads: a request's long work the event loop should not hold (the answer of
        /tokenize: service/tokens.py)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, work)

    def _decode(self, token_ids: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        for i, ids in enumerate(token_ids):
            if ids and not (min(ids) >= 0 and max(ids) < self.vocab_size):
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                raise InvalidArgument(
                    f"ids {i} has token id {bad}, outside the vocabulary [0, {self.vocab_size})", param="ids"
                )
        return self.model.tokenizer.decode_batch(
            [list(ids) for ids in token_ids], skip_special_tokens=skip_special_tokens
        )

    def _tokenize_long(self, texts: list[str]) -> list[Encoding]:
        return encode_long(self.model.tokenizer, texts, self.max_tokens * PREFIX_CHARS_PER_TOKEN, edges=self._edges)

    async def encode_pre(self, req: EncodeInput) -> list[Ids]:
        """Tokenise a request `validate` passed: one int64 array per input, within the model's length and
        vocabulary."""
        truncate = self.auto_truncate if req.truncate is None else req.truncate
        if req.texts:
            prompted = bool(self.prompt(req))
            encodings = await self.tokenize(
                self.prompted(req), truncate=truncate, prompted=prompted, cut_start=req.truncate_start
            )
            return [np.asarray(enc.ids, dtype=np.int64) for enc in encodings]
        return self._check_ids(req.token_ids, truncate=truncate, cut_start=req.truncate_start)

    def prompt(self, req: EncodeInput) -> str:
        """The prompt the request names, or the model's default one; "" for none."""
        name = req.prompt_name or self.default_prompt
        return self.prompts[name] if name else ""

    def prompted(self, req: EncodeInput) -> Sequence[str]:
        """The texts with the request's prompt (`prompt`) put before each."""
        prompt = self.prompt(req)
        return [prompt + text for text in req.texts] if prompt else req.texts

    def encode_post(
        self,
        req: EncodeInput,
        seqs: list[Ids],
        embeddings: Embeddings,
        *,
        tokenization_ns: int = 0,
        spent: Spent | None = None,
    ) -> EncodeOutput:
        model = self.model
        normalize = model.entry.normalize if req.normalize is None else req.normalize
        if req.dimensions is not None:
            # Matryoshka: the leading dimensions are an embedding of their own once renormalised; unnormalised
            # (normalize false, or a model's default), the leading values as they are, as TEI answers them.
            embeddings = np.ascontiguousarray(embeddings[:, : req.dimensions])
        embeddings = l2_normalize(embeddings) if normalize else embeddings
        return EncodeOutput(
            embeddings=embeddings,
            model=model.name,
            version=model.version,
            input_tokens=sum(len(s) for s in seqs),
            tokenization_ns=tokenization_ns,
            queue_ns=0 if spent is None else round(spent.queue * 1e9),
            inference_ns=0 if spent is None else round(spent.inference * 1e9),
        )

    # ---- helpers ----------------------------------------------------------------------------------

    def _tokenize(self, texts: list[str]) -> list[Encoding]:
        """On the loop, text by text: `encode_batch` would hand even a few short texts to the tokeniser's own
        threads and wait there."""
        tokenizer = self.model.tokenizer
        return [tokenizer.encode(text) for text in texts]

    async def _tokenize_cutting_start(self, texts: Sequence[str]) -> list[Encoding]:
        """Texts tokenised by a copy of the tokenizer that cuts a long one's start (made once, off the loop); long
        ones on the tokeniser threads, from their end (`encode_long` with `_suffix`), as the usual way tokenises
        them from their start."""
        loop = asyncio.get_running_loop()
        if self._start_cutting is None:
            self._start_cutting = await loop.run_in_executor(
                self._tokenize_pool, cutting_start, self.model.tokenizer, self.max_tokens
            )
        tokenizer = self._start_cutting
        if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            return [tokenizer.encode(text) for text in texts]
        limit = self.max_tokens * PREFIX_CHARS_PER_TOKEN
        return await loop.run_in_executor(
            self._tokenize_pool, encode_long, tokenizer, list(texts), limit, _suffix, self._edges
        )

    async def _whole_tokenizer(self) -> Tokenizer:
        """The model's tokenizer without truncation, made once: a copy rebuilt from its JSON, not on the loop."""
        if self._untruncated is None:
            loop = asyncio.get_running_loop()
            self._untruncated = await loop.run_in_executor(self._tokenize_pool, untruncated, self.model.tokenizer)
        return self._untruncated

    async def _length(self, text: str) -> tuple[int, int | None]:
        """The untruncated length of a text, for the error message (rare: only on that error), and where only
        its start was measured, how many characters of it (None: all of it).

        A long text is measured on the tokeniser threads, as it was tokenised: a refusal must not hold the
        event loop longer than serving the text would; past the prefix bound only its start is measured, read
        further as `encode_long` reads a text (PREFIX_GROWTH) where that start alone is not past the maximum (a
        run of whitespace: "longer than 2 tokens") or has no word edge to cut before (it was measured whole: 4 MB,
        seconds of the tokeniser for a refusal).
        """
        loop = asyncio.get_running_loop()
        whole = await self._whole_tokenizer()
        limit = self.max_tokens * PREFIX_CHARS_PER_TOKEN
        while True:
            part = _prefix(text, limit, self._edges)
            if part is text and len(text) > limit:  # no edge within its start: a longer one
                limit *= PREFIX_GROWTH
                continue
            if len(part) <= INLINE_TOKENIZE_CHARS:
                length = len(whole.encode(part).ids)
            else:
                encodings = await loop.run_in_executor(self._tokenize_pool, whole.encode_batch, [part])
                length = len(encodings[0].ids)
            if part is text or length > self.max_tokens:
                return length, None if part is text else len(part)
            limit *= PREFIX_GROWTH

    def _too_long(self, index: int, length: int, measured_chars: int | None = None, *, prompted: bool = False) -> str:
        # the prompt only where one was put before the text (never before token ids)
        included = f"(special tokens{' and the prompt' if prompted else ''} included)"
        if measured_chars is not None and length <= self.max_tokens:
            # Its start alone did not overflow (20,000 spaces before the words): no count worth giving.
            return (
                f"input {index} is more than the model's maximum of {self.max_tokens} tokens {included}; "
                "shorten it or set truncate"
            )
        if measured_chars is None:
            size = f"is {length} tokens long"
        else:
            size = f"is longer than {length} tokens (its first {measured_chars} characters alone)"
        return (
            f"input {index} {size}, more than the model's maximum of {self.max_tokens} {included}; "
            "shorten it or set truncate"
        )

    def _truncate(self, ids: Ids, *, cut_start: bool = False) -> Ids:
        """Token ids cut to the model's maximum; where they end with the tokenizer's closing special tokens,
        those stay at the end (the ids a text's truncated encoding has), else the first ids are kept. With
        `cut_start` the last are kept instead, and the opening special tokens where the ids begin with them (the
        ids of a text's encoding cut at its start)."""
        head, tail, keep = self._head, self._tail, self.max_tokens
        trail = tail.size if 0 < tail.size < keep and np.array_equal(ids[-tail.size :], tail) else 0
        if not cut_start:
            return np.concatenate((ids[: keep - trail], ids[ids.size - trail :]))
        lead = head.size if 0 < head.size < keep - trail and np.array_equal(ids[: head.size], head) else 0
        end = ids.size - trail
        return np.concatenate((ids[:lead], ids[end - (keep - lead - trail) :]))

    def _check_ids(
        self, token_ids: Sequence[Sequence[int] | npt.NDArray[np.int64]], *, truncate: bool, cut_start: bool = False
    ) -> list[Ids]:
        seqs = []
        for i, ids in enumerate(token_ids):
            try:
                arr = np.asarray(ids, dtype=np.int64)
            except OverflowError:  # an id past int64 (JSON numbers have no bound): outside any vocabulary
                raise InvalidArgument(
                    f"input {i} has a token id outside the vocabulary [0, {self.vocab_size})", param="input"
                ) from None
            if arr.ndim != 1 or arr.size == 0:
                raise InvalidArgument(f"input {i} is an empty token list", param="input")
            # Every id is checked, those truncate drops too: a list with a bad id is a bad request either way.
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise InvalidArgument(
                    f"input {i} has token id {lo if lo < 0 else hi}, outside the vocabulary [0, {self.vocab_size})",
                    param="input",
                )
            if arr.size > self.max_tokens:
                if not truncate:
                    raise InvalidArgument(self._too_long(i, arr.size), param="input")
                arr = self._truncate(arr, cut_start=cut_start)
            seqs.append(arr)
        return seqs


def untruncated(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that does not truncate (serialised and parsed again: tens of milliseconds for a
    large vocabulary)."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    return copy


def cutting_start(tokenizer: Tokenizer, max_tokens: int) -> Tokenizer:
    """A copy of `tokenizer` that cuts a text past `max_tokens` at its start, keeping its end (its special tokens
    stay, as when it cuts the end)."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.enable_truncation(max_tokens, direction="left")
    return copy


def special_head(tokenizer: Tokenizer) -> npt.NDArray[np.int64]:
    """The ids of the special tokens `tokenizer` puts before every text (none without a post-processor)."""
    enc = tokenizer.encode("a")
    n = next((i for i, special in enumerate(enc.special_tokens_mask) if not special), len(enc.ids))
    return np.asarray(enc.ids[:n], dtype=np.int64)


def special_tail(tokenizer: Tokenizer) -> npt.NDArray[np.int64]:
    """The ids of the special tokens `tokenizer` appends to every text (none without a post-processor)."""
    enc = tokenizer.encode("a")
    mask = enc.special_tokens_mask
    n = len(mask) - next((i + 1 for i in reversed(range(len(mask))) if not mask[i]), 0)
    return np.asarray(enc.ids[len(mask) - n :], dtype=np.int64)


# Characters before which a cut leaves every word of the text before it whole: whitespace, for any tokenizer
# (BERT's WordPiece, SentencePiece's Metaspace, byte-level BPE alike split words there and normalise character by
# character). BERT's pre-tokeniser splits at every punctuation mark too (ASCII's, and here the CJK and full-width
# ones, of Unicode's P categories since its first versions), and its normaliser puts each CJK ideograph apart
# (`handle_chinese_chars`; the ranges of the Basic Multilingual Plane, which every version of it has): a Chinese
# or Japanese text, minified JSON or base64 has no whitespace, and was tokenised whole.
WHITESPACE = " \n\t\r"
PUNCTUATION = (
    "!-/:-@\\[-`{-~"
    "\u3001-\u3003\u3008-\u3011\u3014-\u301f\u3030\u303d"
    "\uff01-\uff03\uff05-\uff0a\uff0c-\uff0f\uff1a\uff1b\uff1f\uff20\uff3b-\uff3d\uff3f\uff5b\uff5d\uff5f-\uff65"
)
CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"


@dataclass(frozen=True)
class WordEdges:
    """Where a long text may be cut for a tokenizer before it is tokenised (`_prefix`, `_suffix`): before one
    character `edge` matches, but never through one of its added tokens (`atoms`: [MASK], [SEP], <s>...), which
    it finds in the raw text before any of this, as a word of its own: cut through, `[MASK]` was `[` and `mask`."""

    edge: re.Pattern[str]
    atoms: re.Pattern[str] | None = None
    longest: int = 0  # the longest atom's length

    def cut_through(self, text: str, at: int) -> tuple[int, int] | None:
        """The start and end of an added token that a cut at `at` would go through, if one does."""
        if self.atoms is None:
            return None
        window = max(0, at - self.longest + 1)
        for m in self.atoms.finditer(text, window, at + self.longest - 1):
            if m.start() < at < m.end():
                return m.start(), m.end()
        return None


WHITESPACE_EDGES = WordEdges(re.compile(f"[{WHITESPACE}]"))


def word_edges(tokenizer: Tokenizer) -> WordEdges:
    """Where `_prefix` and `_suffix` may cut a text for `tokenizer`."""
    edge = WHITESPACE_EDGES.edge
    normalizer = tokenizer.normalizer
    if isinstance(tokenizer.pre_tokenizer, pre_tokenizers.BertPreTokenizer):
        if normalizer is None:
            edge = re.compile(f"[{WHITESPACE}{PUNCTUATION}]")
        elif isinstance(normalizer, normalizers.BertNormalizer):  # another may join characters across one
            edge = re.compile(f"[{WHITESPACE}{PUNCTUATION}{CJK if normalizer.handle_chinese_chars else ''}]")
    # case-blind: an added token may be matched on the normalised (lower-cased) text
    atoms = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if len(t.content) > 1})
    if not atoms:
        return WordEdges(edge)
    return WordEdges(edge, re.compile("|".join(map(re.escape, atoms)), re.IGNORECASE), max(map(len, atoms)))


def encode_long(
    tokenizer: Tokenizer,
    texts: list[str],
    limit: int,
    cut_to: Callable[[str, int, WordEdges], str] | None = None,
    edges: WordEdges = WHITESPACE_EDGES,
) -> list[Encoding]:
    """`tokenizer.encode_batch(texts)`, the same to the last id, with each text longer than `limit` characters
    tokenised from its start (`_prefix`), or for a tokenizer that cuts a text's start from its end (`_suffix` as
    `cut_to`), cut before one of `edges` (`word_edges`). Where that part does not fill the tokenizer's truncation
    length (its encoding does not overflow: a long word, a run of whitespace), or the text has no edge within it, a
    part `PREFIX_GROWTH` times longer is tried, and so on: the text is tokenised in full only once the limit reaches
    its length. The parts a text is read from add up to at most 4/3 of the last limit (a geometric series), which is
    `PREFIX_GROWTH` times the one before, whose part did not fill the model: a 4 MB text whose first word is 8,000
    characters long is read for about 40,000 characters, not 4 MB (its mirror from its end alike, with `_suffix`).

    A text with no edge at all (one word of megabytes) is still tokenised whole, as the tokenizer would: no part of
    it can be cut without changing its tokens (it is searched for one at each limit, a geometric series again)."""
    cut_to = cut_to or _prefix
    encodings: dict[int, Encoding] = {}
    pending: list[int] = list(range(len(texts)))
    while pending:
        parts = [(i, cut_to(texts[i], limit, edges)) for i in pending]
        # `cut_to` gives a text itself where it has no edge within `limit`: a longer limit, before it is read whole
        read = [(i, part) for i, part in parts if part is not texts[i] or len(part) <= limit]
        pending = [i for i, part in parts if part is texts[i] and len(part) > limit]
        for (i, part), enc in zip(read, tokenizer.encode_batch([part for _, part in read]), strict=True):
            if part is not texts[i] and not enc.overflowing:
                pending.append(i)  # the part does not fill the model: a longer one next
            else:
                encodings[i] = enc
        limit = max(limit, 1) * PREFIX_GROWTH  # grows even from 0: the loop ends
    return [encodings[i] for i in range(len(texts))]


def _prefix(text: str, limit: int, edges: WordEdges = WHITESPACE_EDGES) -> str:
    """The start of `text` up to the last of `edges` within its first `limit` characters (or the start of an added
    token that a cut there would go through), or `text` itself (the same object) when it is not longer than that
    or has none there.

    The tokens of a prefix cut before a word's edge are the first tokens of the whole text: where the prefix alone
    overflows the model's maximum, its truncated encoding is the whole text's, to the last id.
    """
    if len(text) <= limit:
        return text
    last = edges.edge.search(text[limit - 1 : 0 : -1])  # backwards from the limit, to the second character
    if not last:
        return text
    end = limit - 1 - last.start()
    if (atom := edges.cut_through(text, end)) is not None:
        end = atom[0]  # before the token: it begins a part of the text of its own
    return text[:end] if end > 0 else text


def _suffix(text: str, limit: int, edges: WordEdges = WHITESPACE_EDGES) -> str:
    """The end of `text` from the first of `edges` within its last `limit` characters (or the end of an added token
    that a cut there would go through), or `text` itself (the same object) when it is not longer than that or has
    none there: `_prefix`'s mirror, for a tokenizer that cuts a text's start. A word that follows its edge is
    tokenised as in the whole text, so where the end alone overflows the model's maximum, its start-cut encoding is
    the whole text's, to the last id (the edge is kept: byte-level BPE writes a whitespace into the word's first
    token, and BERT's punctuation marks are tokens)."""
    if len(text) <= limit:
        return text
    first = edges.edge.search(text, len(text) - limit)
    if not first:
        return text
    start = first.start()
    if (atom := edges.cut_through(text, start)) is not None:
        start = atom[1]  # after the token, which ends a part of the text of its own
    return text[start:] if start < len(text) else text
