"""The server's log lines (service/context.py): where they go when the process's stderr is replaced."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from mhaserve.service.context import Throttle, configure_logging


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


@pytest.mark.parametrize("level", ["info", "debug"])
def test_grpc_aio_s_error_for_an_answer_to_a_client_gone_is_a_debug_line(
    root_logging: None, monkeypatch: pytest.MonkeyPatch, level: str
) -> None:
    """grpc.aio logged an ERROR with a traceback for each streamed answer it could not write because the client
    had cancelled (one a cancel, as many as a client likes); the grpc front's filter makes it a DEBUG line."""
    from mhaserve.service.server import CLIENT_GONE

    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    configure_logging(level)
    logger = logging.getLogger("grpc._cython.cygrpc.test")
    logger.addFilter(CLIENT_GONE)
    try:
        try:
            raise RuntimeError('Failed "execute_batch"')
        except RuntimeError:
            logger.exception("ExecuteBatchError raised in core by servicer method [%s]", "/encoder.v1.X/Y")
            logger.exception("Unexpected [%s] raised by servicer method [%s]", "KeyError", "/encoder.v1.X/Y")
    finally:
        logger.removeFilter(CLIENT_GONE)
    lines = out.getvalue()
    assert "ERROR grpc._cython.cygrpc.test [-] Unexpected [KeyError]" in lines  # another error stays one
    demoted = "DEBUG grpc._cython.cygrpc.test [-] ExecuteBatchError raised in core by servicer method [/encoder.v1.X/Y]"
    assert (demoted in lines) == (level == "debug")
    assert "ERROR grpc._cython.cygrpc.test [-] ExecuteBatchError" not in lines
    assert lines.count("Traceback") == 1  # the other error's


def test_a_throttle_with_a_burst_writes_that_many_lines_an_interval_then_counts() -> None:
    now = [0.0]
    throttle = Throttle(("refused ",), interval=1.0, clock=lambda: now[0], burst=3)

    def line() -> logging.LogRecord:
        return logging.LogRecord("x", logging.INFO, __file__, 1, "refused %s", ("/a",), None)

    assert [throttle.filter(line()) for _ in range(5)] == [True, True, True, False, False]
    now[0] = 0.99
    assert not throttle.filter(line())
    now[0] = 1.0
    record = line()
    assert throttle.filter(record) and record.getMessage() == "refused /a (3 more since the last such line, not logged)"
    assert throttle.filter(line()) and throttle.filter(line()) and not throttle.filter(line())
    throttle.reset()
    assert throttle.filter(line())
