"""A thread hand-off on this VM with nothing else running: the event loop puts an item on a queue a sleeping
thread waits on, and the thread answers through `call_soon_threadsafe`, as the batcher and its inference
thread do; both sides idle 2 ms between hand-offs, as at one client. Prints the medians of 2,000.
Run: python wake.py
"""

import asyncio
import queue
import statistics
import threading
import time


def main() -> None:
    handoffs: queue.SimpleQueue[tuple[asyncio.Future[tuple[float, float, float]], float] | None] = queue.SimpleQueue()
    loop = asyncio.new_event_loop()

    def answer(future: asyncio.Future[tuple[float, float, float]], sent: float, woke: float) -> None:
        future.set_result((sent, woke, time.perf_counter()))

    def worker() -> None:
        while (item := handoffs.get()) is not None:
            future, sent = item
            woke = time.perf_counter()
            loop.call_soon_threadsafe(answer, future, sent, woke)

    threading.Thread(target=worker, daemon=True).start()

    async def run() -> tuple[list[float], list[float]]:
        there, back = [], []
        for _ in range(2000):
            future: asyncio.Future[tuple[float, float, float]] = loop.create_future()
            handoffs.put((future, time.perf_counter()))
            sent, woke, answered = await future
            there.append((woke - sent) * 1e6)
            back.append((time.perf_counter() - answered) * 1e6)
            await asyncio.sleep(0.002)
        return there, back

    there, back = loop.run_until_complete(run())
    handoffs.put(None)
    print(f"to the thread: p50 {statistics.median(there):.0f} us, back: p50 {statistics.median(back):.0f} us")


if __name__ == "__main__":
    main()
