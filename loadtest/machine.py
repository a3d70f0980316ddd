"""The machine a report was measured on, described once for every report (`mhaserve bench`, `make reliability`).

Figures of a load test mean little without it: which CPU and how many cores, how much memory, what
else was running (the load average), which versions of the packages that do the work, which commit.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from mhaserve.runtime import int8_kernels

# The packages whose versions move the figures; one that is not installed is left out.
PACKAGES = ("onnxruntime-gpu", "onnxruntime", "torch", "grpcio", "numpy", "tokenizers")


def machine(packages: Sequence[str] = PACKAGES) -> dict[str, Any]:
    """cpu, int8_kernel, cores, memory_gib (0 when unknown), platform, python, packages {name: version}, commit,
    load."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = int(line.split()[1]) / 2**20
    found = {}
    for name in packages:
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return {
        "cpu": cpu,
        # what the int8 graph's figures hang on, and the model name ("Intel(R) Xeon(R) Processor" in a VM) hides
        "int8_kernel": int8_kernels.describe(),
        "cores": os.cpu_count() or 1,
        "memory_gib": memory,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": found,
        "commit": commit(),
        "load": load(),
    }


def load() -> str:
    """The load averages over 1, 5 and 15 minutes: what else ran on the machine ("-" where unknown)."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "-"


def commit() -> str:
    """The checkout's short commit ("unknown" outside a git checkout)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
