"""The progress display of the long commands (`mhaserve export`, `mhaserve bench`): numbered steps on stderr.

It lives here, under both, because the export (product) and the bench (tooling) show the same display
and neither may import the other's layer.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import TextIO


class Progress:
    """Numbered steps with their durations, so that a long run shows where it is and where the time went.

    A step is one line, `[n/total] what ... result (elapsed s, total s in all)`; it notes its result in
    the dict it yields (`done` when it notes none, `failed` when it raises). During a step that lets
    other things print (a child process, the log lines of what it calls), the line would be torn:
    `step(..., reports=True)` ends it at once and gives the result on a line that repeats the step's
    name. `say()` prints a line of its own, ending the step's line first if need be.
    """

    def __init__(self, total: int, out: TextIO | None = None) -> None:
        # stderr looked up now, not at import: a test that captures it replaces sys.stderr
        self.total, self.n, self.out, self.t0 = total, 0, out or sys.stderr, time.perf_counter()
        self._open = False  # the current step's line waits for its result

    def say(self, text: str) -> None:
        self._break()
        print(text, file=self.out, flush=True)

    @contextlib.contextmanager
    def step(self, what: str, *, reports: bool = False) -> Iterator[dict[str, str]]:
        self._break()
        self.n += 1
        name = f"[{self.n}/{self.total}] {what}"
        note: dict[str, str] = {"result": ""}
        print(f"{name} ...", end="", file=self.out, flush=True)
        self._open = True
        if reports:
            self._break()
        t = time.perf_counter()
        # A log line from what the step calls (a warning) ends the step's line first, as say() does.
        handlers = list(logging.getLogger().handlers)  # those it was added to, whatever changes meanwhile
        for handler in handlers:
            handler.addFilter(self._log_line)
        try:
            yield note
        except BaseException:
            # The line ends either way: the error the caller prints next stands on a line of its own.
            self._end(name, "failed", t)
            raise
        finally:
            for handler in handlers:
                handler.removeFilter(self._log_line)
        self._end(name, note["result"] or "done", t)

    def _log_line(self, record: logging.LogRecord) -> bool:
        self._break()
        return True

    def _break(self) -> None:
        if self._open:
            print(file=self.out, flush=True)
            self._open = False

    def _end(self, name: str, result: str, started: float) -> None:
        now = time.perf_counter()
        times = f"({now - started:.1f} s, {now - self.t0:.0f} s in all)"
        # Something printed since the step began: say again which step this result is for.
        line = f" {result} {times}" if self._open else f"{name}: {result} {times}"
        print(line, file=self.out, flush=True)
        self._open = False
