"""The calls being handled now, of every protocol: the drain waits until there are none."""

from __future__ import annotations

import asyncio


class InFlight:
    """A count of calls in progress, and an event set whenever it is zero. Used on the event loop only."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def begin(self) -> None:
        self.count += 1
        self.idle.clear()

    def end(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.idle.set()
