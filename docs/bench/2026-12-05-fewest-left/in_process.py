"""Eight requests of 16 inputs of 256 tokens queued together (1 ms apart), a scripted engine of 10 ms a batch, the
CPU's limits: after how many of the 128 batches, and how many seconds, each request is answered, for one and two
workers and each policy. Run from a checkout whose policies to measure: python in_process.py
"""

from __future__ import annotations

import asyncio

import numpy as np

from mhaserve.service.batching import CPU_LIMITS, Batcher
from mhaserve.testing.engines import ScriptedEngine


async def burst(workers: int, batching: str) -> list[tuple[float, int]]:
    engine = ScriptedEngine(seconds_per_batch=0.01)
    b = Batcher(engine, limits=CPU_LIMITS, batching=batching, workers=workers)  # type: ignore[arg-type]
    b.start()
    await b.submit([np.arange(3)])  # a warm-up text, as the server's clients send
    loop = asyncio.get_running_loop()
    t0, answered = loop.time(), []

    async def request(i: int) -> None:
        await b.submit([np.full(256, i + 1) for _ in range(16)])
        answered.append((round(loop.time() - t0, 2), len(engine.batches) - 1))

    calls = []
    for i in range(8):
        calls.append(asyncio.ensure_future(request(i)))
        await asyncio.sleep(0.001)
    await asyncio.gather(*calls)
    await b.close()
    return answered


for workers in (1, 2):
    for batching in ("length", "arrival"):
        print(workers, "worker(s),", batching, "(seconds, batches):", asyncio.run(burst(workers, batching)))
