"""The machine the reports describe: one description, what both the bench and the reliability report show."""

from __future__ import annotations

from mhaserve.loadtest.machine import PACKAGES, machine


def test_the_description_holds_what_both_reports_show() -> None:
    m = machine((*PACKAGES, "hypothesis", "no-such-package"))
    assert set(m) == {"cpu", "int8_kernel", "cores", "memory_gib", "platform", "python", "packages", "commit", "load"}
    assert m["cpu"] and m["cores"] >= 1 and m["memory_gib"] > 0
    assert {"grpcio", "onnxruntime-gpu", "hypothesis"} <= set(m["packages"])
    assert "no-such-package" not in m["packages"]  # absent packages are left out, not guessed
