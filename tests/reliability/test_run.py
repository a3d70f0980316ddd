"""`make reliability`'s runner itself (loadtest/reliability/run.py), on the tiny model: its in-process scenarios
run the servers the short versions here run. Its own settings once drifted from theirs: two inference workers by
default computed the batches its deadline scenario holds back, and `make reliability` stopped with a timeout
while `make test` passed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mhaserve.loadtest.reliability.run import SCENARIOS, main


@pytest.mark.slow
def test_the_runners_in_process_scenarios_pass_their_checks(tiny_repo: Path, tmp_path: Path) -> None:
    report = tmp_path / "reliability.md"
    argv = ["--repository", str(tiny_repo), "--model", "tiny", "--quick", "--scenarios", "deadlines,faults"]
    levels = {name: logging.getLogger(name).level for name in ("mhaserve.service", "grpc")}
    assert main([*argv, "--output", str(report)]) == 0
    # It quiets the server's loggers while it runs, and only then: the tests after it read their lines.
    assert {name: logging.getLogger(name).level for name in levels} == levels
    text = report.read_text()
    assert "## Deadlines and cancellation" in text and "## Faults" in text and "## Overload" not in text
    assert "checks passed.**" in text and "Failed:" not in text and "**FAIL**" not in text


def test_an_unknown_scenario_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--scenarios", "deadlines,sok", "--output", str(tmp_path / "r.md")])
    assert e.value.code == 2
    assert f"unknown scenario(s) sok: choose from {', '.join(SCENARIOS)}" in capsys.readouterr().err


def test_outputs_and_model_are_checked_before_anything_runs(
    tiny_repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--json results/reliability.json` (as the Makefile suggests) on a fresh clone, with no results/, failed with a
    traceback once the whole run (10 minutes) was over, losing its figures; so did an --output that is a folder, and
    a model the repository lacks failed with a traceback. Each is now a usage error before any scenario runs; a
    missing folder is made."""
    file = tmp_path / "a-file"
    file.write_text("")
    base = ["--repository", str(tiny_repo), "--model", "tiny", "--quick", "--scenarios", "deadlines"]
    for argv, message in (
        ([*base, "--output", str(tmp_path)], f"--output {tmp_path} is a folder"),
        ([*base, "--output", str(tmp_path / "r.md"), "--json", str(file / "r.json")], f"--json {file / 'r.json'}:"),
        (["--repository", str(tiny_repo), "--model", "nope", "--output", str(tmp_path / "r.md")], "nope"),
        (["--repository", str(tmp_path / "none"), "--output", str(tmp_path / "r.md")], str(tmp_path / "none")),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "r.md").exists()
    # a folder that does not exist yet is made, as the report's own folder always was
    assert (
        main([*base, "--output", str(tmp_path / "out" / "r.md"), "--json", str(tmp_path / "results" / "r.json")]) == 0
    )
    assert (tmp_path / "results" / "r.json").is_file()
