"""wake.py with the model between the hand-offs: the inference thread runs the fused graph on one short text
(ONNX Runtime's session as the server opens it: all cores, spinning during runs only) and then hands back
through `call_soon_threadsafe`, so the hand-back comes right after a run, as in the server. Prints, per mode,
the medians of 500 short texts: to the thread, the run, and back to the loop. Modes: `model` (the server's
session), `busy` (4 ms of pure Python instead of the model: a core busy without ONNX Runtime's pool), `model, 1
thread` (one intra-op thread: no pool thread), `model, no spinning` (the pool thread sleeps at every barrier).
Run from the repository root: python docs/bench/2026-11-27-fourteenth/wake_model.py
"""

import asyncio
import queue
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving

Handoff = tuple[asyncio.Future[tuple[float, float, float, float]], float, np.ndarray] | None


def main() -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    from mhaserve.runtime.engine import OnnxEngine

    kw = {"max_seq_len": entry.manifest.max_seq_len, "vocab_size": entry.manifest.vocab_size, "device": "cpu"}
    engines = {
        "model": OnnxEngine(entry.graph_path, **kw),  # type: ignore[arg-type]
        "model, 1 thread": OnnxEngine(entry.graph_path, intra_op_threads=1, **kw),  # type: ignore[arg-type]
        "model, no spinning": OnnxEngine(entry.graph_path, **kw),  # type: ignore[arg-type]
    }
    import onnxruntime as ort

    from mhaserve.runtime import engine as engine_module

    opts = engine_module._session_options(None, 1, spin=False)
    engines["model, no spinning"].session = ort.InferenceSession(
        str(entry.graph_path), sess_options=opts, providers=["CPUExecutionProvider"]
    )
    texts = [t for t in Path("loadtest/texts/short.txt").read_text().splitlines() if t.strip()][:500]
    rows = [np.array([tokenizer.encode(t).ids], dtype=np.int64) for t in texts]
    for mode in ("model", "busy", "model, 1 thread", "model, no spinning", "model", "model, 1 thread",
                 "model, no spinning"):  # fmt: skip
        handoffs: queue.SimpleQueue[Handoff] = queue.SimpleQueue()
        loop = asyncio.new_event_loop()

        def answer(future: asyncio.Future[tuple[float, float, float, float]], *stamps: float) -> None:
            future.set_result((*stamps, time.perf_counter()))  # type: ignore[arg-type]

        def worker(mode: str = mode, handoffs: queue.SimpleQueue[Handoff] = handoffs,
                   loop: asyncio.AbstractEventLoop = loop) -> None:  # fmt: skip
            while (item := handoffs.get()) is not None:
                future, sent, ids = item
                woke = time.perf_counter()
                if mode in engines:
                    engines[mode].run(ids, np.ones_like(ids))
                else:
                    end = woke + 0.004
                    while time.perf_counter() < end:
                        pass
                loop.call_soon_threadsafe(answer, future, sent, woke, time.perf_counter())

        threading.Thread(target=worker, daemon=True).start()

        async def run(handoffs: queue.SimpleQueue[Handoff] = handoffs) -> list[tuple[float, float, float]]:
            out = []
            for ids in rows:
                future: asyncio.Future[tuple[float, float, float, float]] = asyncio.get_running_loop().create_future()
                handoffs.put((future, time.perf_counter(), ids))
                sent, woke, done, answered = await future
                out.append(((woke - sent) * 1e6, (done - woke) * 1e6, (time.perf_counter() - done) * 1e6))
                await asyncio.sleep(0.002)
            return out

        got = loop.run_until_complete(run())
        handoffs.put(None)
        loop.close()
        there, ran, back = (statistics.median(x[i] for x in got) for i in range(3))
        print(f"{mode}: to the thread {there:.0f} us, in the thread {ran:.0f} us, back to the loop {back:.0f} us")


if __name__ == "__main__":
    main()
