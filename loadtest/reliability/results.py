"""What a reliability run measured: the sizes it ran at, each check and whether it passed, the figures.

The driver (run.py) fills a Run; the report (report.py) renders one; neither imports the other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("reliability")

# The overload server's --max-client-batch-size: at most its queue (64 inputs), or it refuses to start.
OVERLOAD_CLIENT_BATCH = 8


@dataclass(frozen=True)
class Sizes:
    """How long each scenario runs; `quick` is for trying the driver itself."""

    fuzz_examples: int = 1500
    overload_factors: tuple[float, ...] = (2.5, 5.0, 10.0)
    overload_burst: float = 8.0
    overload_measure: float = 4.0
    deadline_cycles: int = 20
    fault_requests: int = 3000
    hang_cycles: int = 5
    soak_seconds: float = 180.0
    shutdown_load: float = 5.0


@dataclass
class Check:
    """One criterion the issue sets, and whether this run met it."""

    scenario: str
    what: str
    passed: bool


@dataclass
class Run:
    """Everything the report shows."""

    command: str
    started: str
    machine: dict[str, str]
    model: str
    sizes: Sizes
    results: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def check(self, scenario: str, what: str, passed: bool) -> None:
        self.checks.append(Check(scenario, what, bool(passed)))
        log.info("%s %s: %s", "PASS" if passed else "FAIL", scenario, what)
