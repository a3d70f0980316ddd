"""Measuring on a shared machine: CPU accounting, and a guard that measures again what other work disturbed.

Every measurement records the CPU other processes took while it ran (the whole machine's busy time minus
the benchmark's own processes). One that ran beside more than `max_other_cores` of other work is taken
again, after waiting for the machine to calm down, up to `retries` times; the least disturbed attempt is
kept, and the report says how disturbed each figure was.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process and its threads (Linux /proc; None elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


# What each of the server's threads is, by its OS name (service/threads.py names the server's pools; the
# event loop is the main thread, whose id is the process's): the threads of ONNX Runtime's intra-op pool
# and of the tokenizer's own pool carry the process's name and count as `other`.
THREAD_ROLES = {"inference": "inference", "tokenize": "tokenize", "event_engine": "grpc", "grpc_global_tim": "grpc"}


def cpu_seconds_by_thread(pid: int) -> dict[tuple[int, str], float] | None:
    """User + system CPU seconds of each of a process's threads, by (thread id, OS name) (Linux /proc; None
    elsewhere). Threads that ended since the last reading are not counted."""
    threads: dict[tuple[int, str], float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        threads[(int(task.name), name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return threads


def thread_cpu_seconds(pid: int) -> dict[str, float] | None:
    """User + system CPU seconds of a process's threads by role: event loop, inference, tokenize, grpc, other
    (Linux /proc; None elsewhere). Threads that ended since the last reading are not counted."""
    threads = cpu_seconds_by_thread(pid)
    if threads is None:
        return None
    roles: dict[str, float] = {}
    for (tid, name), seconds in threads.items():
        role = "event loop" if tid == pid else THREAD_ROLES.get(name, "other")
        roles[role] = roles.get(role, 0.0) + seconds
    return roles


def self_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine_cpu() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine, all cores (Linux /proc/stat; None elsewhere)."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    values = [int(v) for v in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already counted in user
    return (total - idle) / TICKS, total / TICKS


def busy_cores(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Cores busy on the whole machine between two `machine_cpu()` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


@dataclass(frozen=True)
class Guard:
    """How much other work a measurement tolerates, and how hard to try for a quiet one."""

    max_other_cores: float = 0.1
    retries: int = 2
    quiet_wait_s: float = 30.0

    @property
    def enabled(self) -> bool:
        return self.retries > 0

    def wait_for_quiet(self, sample_s: float = 1.0) -> float | None:
        """Wait (up to `quiet_wait_s`) until the machine is idle but for `max_other_cores`; the last reading."""
        deadline = time.monotonic() + self.quiet_wait_s
        busy = None
        while True:
            before = machine_cpu()
            time.sleep(sample_s)
            busy = busy_cores(before, machine_cpu())
            if busy is None or busy <= self.max_other_cores or time.monotonic() >= deadline:
                return busy

    def measure(self, run: Callable[[], dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
        """`run()` (a dict with `other_cpu_cores`), again while other work disturbed it; the least disturbed."""
        best: dict[str, Any] | None = None
        attempts = 0
        for attempt in range(self.retries + 1):
            if self.enabled:
                self.wait_for_quiet()
            result = run()
            attempts = attempt + 1
            other = result.get("other_cpu_cores")
            if best is None or (other or 0.0) < (best.get("other_cpu_cores") or 0.0):
                best = result
            if other is None or other <= self.max_other_cores:
                break
            if attempt < self.retries:
                say(f"(other processes took {other:.2f} cores: measuring again)")
        assert best is not None
        other = best.get("other_cpu_cores")
        best["attempts"] = attempts
        best["disturbed"] = other is not None and other > self.max_other_cores
        return best
