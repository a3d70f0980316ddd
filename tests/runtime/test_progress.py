"""The progress display of export and bench: one line a step, whole lines whatever else prints."""

from __future__ import annotations

import io
import logging
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


def test_a_log_line_during_a_step_stands_on_a_line_of_its_own() -> None:
    """A warning logged by what a step calls (a checkpoint's max_seq_length capped) was printed in the middle of
    the step's line: "[1/5] loading ...2026-... WARNING ...", then " done" on a line of its own."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger("tests.progress")
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        progress = Progress(2, out)
        with progress.step("loading"):
            log.warning("max_seq_length capped")
        with progress.step("writing"):
            pass
        log.warning("after the steps")
    finally:
        root.removeHandler(handler)
    assert _lines(out) == [
        "[1/2] loading ...",
        "WARNING max_seq_length capped",
        "[1/2] loading: done (T)",
        "[2/2] writing ... done (T)",
        "WARNING after the steps",
    ]
