"""Dynamic batching: inputs of many requests coalesced into padded batches under a token budget.

batcher.py (the queue's worker: admit, submit, run batches), policies.py (which inputs form a batch),
queue.py (what waits), padding.py, limits.py (and their per-device defaults), watchdog.py (a bound on
each batch's compute time).
"""

from mhaserve.service.batching.batcher import Batcher
from mhaserve.service.batching.limits import CPU_LIMITS, CUDA_LIMITS, Limits
from mhaserve.service.batching.policies import BATCHING, Batching
from mhaserve.service.batching.queue import Embeddings, Ids, Spent, Ticket

__all__ = [
    "BATCHING",
    "CPU_LIMITS",
    "CUDA_LIMITS",
    "Batcher",
    "Batching",
    "Embeddings",
    "Ids",
    "Limits",
    "Spent",
    "Ticket",
]
