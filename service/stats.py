"""Per-model inference statistics, in the shape of Triton's ModelStatistics (the "statistics" extension).

The pipeline feeds them for every request of every API (encoder.v1, the Open Inference Protocol, OpenAI's),
and the KServe adapters for the requests they refuse at decode (Pipeline.refused): Triton's statistics
describe a model's load, whichever client sent it. What the pipeline times per request: the whole request
(success or fail), validation and tokenisation (compute_input), and normalisation (compute_output); and per
successful request, as Triton counts them, what the batcher noted of it (batching.Spent): its wait from the
queue until the model began its first input (queue), and from then until the model ended its last
(compute_infer: a batch shared by several requests counts for each, its time in each). execution_count is
the batches run, the count of the batcher's `mhaserve_inference_duration_seconds` histogram.

Durations are cumulative nanoseconds, as Triton reports them; clients such as perf_analyzer take the
difference of two readings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import Histogram

from mhaserve.service.metrics import ModelMetrics


@dataclass(frozen=True)
class Duration:
    """How many times something happened and how long it took in all."""

    count: int = 0
    ns: int = 0

    def plus(self, ns: int) -> Duration:
        return Duration(self.count + 1, self.ns + ns)


@dataclass(frozen=True)
class Snapshot:
    """The statistics at one moment."""

    last_inference_ms: int
    inference_count: int
    execution_count: int
    success: Duration
    fail: Duration
    queue: Duration
    compute_input: Duration
    compute_infer: Duration
    compute_output: Duration


def _histogram_total(histogram: Histogram) -> Duration:
    """A histogram's observation count and sum (seconds), as a Duration in nanoseconds."""
    count, total = 0.0, 0.0
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return Duration(int(count), round(total * 1e9))


class ModelStats:
    """Counters for one served model version; updated and read on the event loop."""

    def __init__(self, metrics: ModelMetrics) -> None:
        self.metrics = metrics
        self._success = Duration()
        self._fail = Duration()
        self._queue = Duration()
        self._compute_input = Duration()
        self._compute_infer = Duration()
        self._compute_output = Duration()
        self._inference_count = 0
        self._last_inference_ms = 0

    def succeeded(
        self, *, inputs: int, total_ns: int, input_ns: int, queue_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        """A request embedded `inputs` inputs in `total_ns`: `input_ns` before the batcher, `queue_ns` in its queue,
        `infer_ns` in the model, `output_ns` after it."""
        self._success = self._success.plus(total_ns)
        self._queue = self._queue.plus(queue_ns)
        self._compute_input = self._compute_input.plus(input_ns)
        self._compute_infer = self._compute_infer.plus(infer_ns)
        self._compute_output = self._compute_output.plus(output_ns)
        self._inference_count += inputs
        self._last_inference_ms = time.time_ns() // 1_000_000

    def failed(self, total_ns: int) -> None:
        """A request failed (invalid, over a limit, cancelled, or its batch failed) after `total_ns`."""
        self._fail = self._fail.plus(total_ns)

    def snapshot(self) -> Snapshot:
        return Snapshot(
            last_inference_ms=self._last_inference_ms,
            inference_count=self._inference_count,
            execution_count=_histogram_total(self.metrics.inference).count,
            success=self._success,
            fail=self._fail,
            queue=self._queue,
            compute_input=self._compute_input,
            compute_infer=self._compute_infer,
            compute_output=self._compute_output,
        )
