"""The server's log lines (service/context.py): where they go when the process's stderr is replaced."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from mhaserve.service.context import configure_logging


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
