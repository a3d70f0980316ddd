"""A scripted engine: deterministic answers, and faults on cue, for what a real model does only on a bad day.

`ScriptedEngine` answers each input with (real length, first id, sum of real ids, 1.0) before
normalisation (`expected_row`), so a client can check every answer without a reference model. It can
cost a fixed time per batch (a known capacity), raise on batches holding a marker token id, or hang
on them until released (or for a while); `gates` hold batches each until its own gate opens. Every
batch's token rows are recorded (`batches`), to prove what did or did not reach the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from mhaserve.runtime.repository import EngineFactory, ModelEntry

DIMENSIONS = 4
# What an engine fault looks like: several lines, as a real one's traceback would; none may reach a client.
FAULT = "injected engine fault\nTraceback-looking detail that must not reach clients"


def expected_row(ids: Sequence[int]) -> list[float]:
    """What ScriptedEngine answers for one input (before normalisation)."""
    return [float(len(ids)), float(ids[0]), float(sum(ids)), 1.0]


class ScriptedEngine:
    """See the module docstring. `hang_for` None hangs until `release` is set; `hanging` is set meanwhile."""

    providers = ["ScriptedExecutionProvider"]

    def __init__(
        self,
        *,
        seconds_per_batch: float = 0.0,
        fail_on: int | None = None,
        hang_on: int | None = None,
        hang_for: float | None = None,
        gates: Sequence[int] = (),
        record: bool = True,
    ) -> None:
        self.seconds_per_batch = seconds_per_batch
        self.fail_on = fail_on
        self.hang_on = hang_on
        self.hang_for = hang_for
        self.release = threading.Event()
        self.hanging = threading.Event()
        # A batch whose first token has a gate waits until that gate is set: a test releases batches one by one.
        self.gates = {token: threading.Event() for token in gates}
        self.record = record  # off for long runs, where the record would itself grow memory
        self.batches: list[list[list[int]]] = []
        self.besides: list[bool] = []  # each recorded batch's `beside`, as the batcher told it
        self._lock = threading.Lock()

    def run(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64], *, beside: bool = False
    ) -> npt.NDArray[np.float32]:
        if self.record:
            rows = [[int(i) for i in ids[m == 1]] for ids, m in zip(input_ids, attention_mask, strict=True)]
            with self._lock:
                self.batches.append(rows)
                self.besides.append(beside)
        if self.seconds_per_batch:
            time.sleep(self.seconds_per_batch)
        if (gate := self.gates.get(int(input_ids[0, 0]))) is not None:
            gate.wait()
        if self.hang_on is not None and (input_ids == self.hang_on).any():
            self.hanging.set()
            self.release.wait(self.hang_for)
            self.hanging.clear()
        if self.fail_on is not None and (input_ids == self.fail_on).any():
            raise RuntimeError(FAULT)
        lengths = attention_mask.sum(1)
        real = input_ids * attention_mask
        out = np.stack([lengths, input_ids[:, 0], real.sum(1), np.ones(len(lengths))], 1)
        return out.astype(np.float32)

    def seen(self, token: int) -> bool:
        """Whether any input holding `token` reached the model."""
        with self._lock:
            return any(token in row for batch in self.batches for row in batch)

    def factory(self) -> EngineFactory:
        """Every version served on this one engine, which outlives them: so each version's close finds its engine
        alive and runs the server's full collection (tests/service/test_models.py `_own_engines` where that
        matters: a close then costs about a second in the whole suite's process)."""

        def make(entry: ModelEntry) -> ScriptedEngine:
            return self

        return make


def parse(spec: str) -> ScriptedEngine:
    """`slow:SECONDS`, `fail:ID`, `hang:ID[:SECONDS]`, joined by commas: `slow:0.05,hang:99`."""
    kwargs: dict[str, float | int | None] = {}
    for part in filter(None, spec.split(",")):
        kind, _, value = part.partition(":")
        if kind == "slow":
            kwargs["seconds_per_batch"] = float(value)
        elif kind == "fail":
            kwargs["fail_on"] = int(value)
        elif kind == "hang":
            token, _, seconds = value.partition(":")
            kwargs["hang_on"] = int(token)
            kwargs["hang_for"] = float(seconds) if seconds else None
        else:
            raise ValueError(f"unknown engine spec {part!r}: use slow:SECONDS, fail:ID or hang:ID[:SECONDS]")
    return ScriptedEngine(**kwargs)  # type: ignore[arg-type]
