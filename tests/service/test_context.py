"""The server's log lines (service/context.py): where they go when the process's stderr is replaced."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mhaserve.service.context import configure_logging


@pytest.fixture
def root_logging() -> Iterator[None]:
    """configure_logging replaces the root logger's handlers: put the test run's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_log_follows_stderr_when_the_host_replaces_it(root_logging: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that swaps sys.stderr and closes the old one (pytest's capture between tests, an application
    embedding the server) must not leave the server writing into a closed file: before, every later line
    was lost to "--- Logging error --- ... I/O operation on closed file" (seen in CI's output)."""
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("info")
    log = logging.getLogger("mhaserve.test")
    log.info("one")
    assert first.getvalue().rstrip().endswith("INFO mhaserve.test [-] one")

    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    first.close()
    log.info("two")
    assert "Logging error" not in second.getvalue()
    assert second.getvalue().rstrip().endswith("INFO mhaserve.test [-] two")


def test_a_serve_run_in_process_leaves_its_log_on_the_stderr_of_the_moment(
    root_logging: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`main(["serve", ...])` called in process (as tests/cli does) configures the server's logging, and its
    handler outlived the stderr it was made with: CI's "Logging error" lines came from it."""
    from mhaserve.cli.main import main

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    # a repository with no model: logging is configured, then the server fails to serve
    assert main(["serve", "--repository", str(tmp_path), "--port", "0", "--http-port", "0", "--metrics-port", "0"]) != 0
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    first.close()
    logging.getLogger("mhaserve.test").info("after")
    assert "Logging error" not in second.getvalue()
    assert second.getvalue().rstrip().endswith("INFO mhaserve.test [-] after")
