"""The batcher's and the API's limits, and their defaults per device."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """The batcher's and the API's limits, once the device is known."""

    max_batch_tokens: int
    max_wait_ms: float
    max_queue_size: int
    max_client_batch_size: int
    max_padding: float  # the length policy's cap on a batch's padding, a fraction of its tokens


# A GPU turns a wide batch into throughput; a CPU does not, so it gets a far smaller budget and a shorter
# wait. On a CPU a thread computes within 5 % as many texts a second in batches of 256 tokens as of 1,024,
# and fewer past that (MiniLM, one thread: about half at 8,192); what a bigger budget adds is time a batch
# holds its worker: a query that comes meanwhile waits it out, and the clients of a batch of long texts all
# wait for its longest. 256 tokens (the model's longest input alone, or about ten short texts) against
# 8,192, with two workers on 2 cores, alternated: short and mixed texts 1.02-1.11x a second, p99
# 0.75-0.85x, fixed 128-token inputs 0.99-1.01x; a query beside indexing clients' 64-text requests 0.54-0.76x
# its mean latency (docs/benchmarks.md, "A smaller token budget on a CPU"). An input longer than the budget
# is a batch alone. A model twice as wide, of 512 tokens, reads the same in process: 256 within the rounds'
# spread of the best on every workload, its 512-token inputs alone no slower than 16 to a batch
# (docs/benchmarks.md, "The token budget on a wider, longer model").
#
# Padding is computed like real tokens. On a CPU, batching buys little (MiniLM on 2 cores: 1.3x from
# batch 1 to its best batch), so padding soon costs more than batching gains: on the mixed workload of
# docs/benchmarks.md a cap of 0.1 served about 10 % more than 0.2, and 0.35 about 25 % less. A GPU gains
# more from wide batches, so it may trade more padding for them (an estimate: not yet measured on a GPU).
#
# A request may hold as many inputs as OpenAI takes (2,048), on either device: OpenAI-compatible clients send
# batches of their own default size (LlamaIndex 100, LangChain InfinityEmbeddings 128, LangChain.js 512,
# langchain-openai 1,000, chromadb and LiteLLM all they are given) and none of them splits a refused one. The
# batcher splits a request across batches and the request with the fewest inputs left goes first, so a query
# beside a large request waits for one of its batches, not for all (MiniLM on 2 shared cores, measured while
# requests took turns: a query's p50 45 ms, 5 alone, beside back-to-back requests of 2,048 short texts of 10 s
# each). The queue counts inputs, so it holds four such requests: at 2,048 one had to find it empty.
CPU_LIMITS = Limits(
    max_batch_tokens=256, max_wait_ms=2.0, max_queue_size=8192, max_client_batch_size=2048, max_padding=0.1
)
CUDA_LIMITS = Limits(
    max_batch_tokens=32768, max_wait_ms=5.0, max_queue_size=8192, max_client_batch_size=2048, max_padding=0.3
)
