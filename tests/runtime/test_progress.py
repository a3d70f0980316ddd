"""The progress display of export and bench: one line a step, whole lines whatever else prints."""

from __future__ import annotations

import io
import re

import pytest

from mhaserve.runtime.progress import Progress


def _lines(out: io.StringIO) -> list[str]:
    # durations vary: compare the lines with them blanked
    return [re.sub(r"\(\d+\.\d s, \d+ s in all\)", "(T)", line) for line in out.getvalue().splitlines()]


def test_a_step_is_one_line_with_its_result_and_times() -> None:
    out = io.StringIO()
    progress = Progress(2, out)
    with progress.step("loading") as note:
        note["result"] = "3 inputs"
    with progress.step("writing"):
        pass
    assert _lines(out) == ["[1/2] loading ... 3 inputs (T)", "[2/2] writing ... done (T)"]


def test_output_during_a_step_never_tears_its_line() -> None:
    out = io.StringIO()
    progress = Progress(3, out)
    with progress.step("measuring", reports=True):
        out.write("a child's line\n")
    with progress.step("point") as note:
        progress.say("waiting for the machine to quiet down")
        note["result"] = "12 seq/s"
    with pytest.raises(RuntimeError), progress.step("publishing"):
        raise RuntimeError("disk full")
    progress.say("mhaserve export: error: disk full")
    assert _lines(out) == [
        "[1/3] measuring ...",
        "a child's line",
        "[1/3] measuring: done (T)",
        "[2/3] point ...",
        "waiting for the machine to quiet down",
        "[2/3] point: 12 seq/s (T)",
        "[3/3] publishing ... failed (T)",
        "mhaserve export: error: disk full",
    ]
