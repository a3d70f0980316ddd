"""A short soak: steady load on a real server process, its memory, descriptors and threads sampled.

The short version only catches gross leaks (descriptors or threads that grow with requests, memory
that climbs by tens of MiB in seconds); `make reliability` runs minutes and reports the slope."""

from __future__ import annotations

import pytest

from mhaserve.loadtest.reliability.scenarios.load import queue_texts, text_requests
from mhaserve.loadtest.reliability.scenarios.soak import soak
from tests.reliability.conftest import Spawn


@pytest.mark.slow
def test_steady_load_leaks_no_descriptors_threads_or_memory(spawn: Spawn, capsys: pytest.CaptureFixture[str]) -> None:
    proc = spawn("--max-wait-ms", "2")
    address = proc.wait_serving()
    result = soak(proc, text_requests(address, queue_texts(64)), seconds=12, clients=4, interval=0.5, warmup=4)
    steady = result.steady()
    first, last = steady[0], steady[-1]
    with capsys.disabled():
        print(
            f"\nsoak: {result.requests} requests in {result.seconds:g} s, codes {dict(result.codes)}; RSS "
            f"{first.rss_kib} -> {last.rss_kib} KiB (slope {result.rss_slope_kib_per_min:+.0f} KiB/min), "
            f"fds {first.fds} -> {last.fds}, threads {first.threads} -> {last.threads}"
        )
    assert result.codes == {"OK": result.requests} and result.requests > 100
    assert max(s.fds for s in steady) <= first.fds + 4, "descriptors grow with requests"
    assert max(s.threads for s in steady) <= first.threads + 2, "threads grow with requests"
    assert last.rss_kib - first.rss_kib < 32 * 1024, "resident memory grew by more than 32 MiB in seconds"
