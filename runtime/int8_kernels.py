"""Which int8 matrix-product kernels ONNX Runtime's CPU provider runs here: what the int8 graph's speed hangs on.

The int8 graph's gain over fp32 follows the CPU's int8 instructions, not the graph: measured on this project's
2-core VMs, about 1.6x with AVX2 alone, 2x with AVX-512 VNNI, and 2.2-2.5x with AMX (docs/benchmarks.md). ONNX
Runtime's MLAS library picks its integer GEMM once, when it loads, in this order: AMX tiles (AMX-TILE and
AMX-INT8), then AVX-512 VNNI, AVX-512, AVX-VNNI, AVX2. AMX has one more condition: Linux hands a process the
tile registers only after it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, Linux 5.16 or later), and where the
request fails (an older kernel, a seccomp profile that refuses it) MLAS quietly takes the next kernel. So
the answer reads the CPU's flags and, for AMX, makes the same request (granted once, it stays granted; asking
again is harmless), so that it holds for ONNX Runtime in this process whether or not it has loaded yet.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
from collections.abc import Iterable
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

AMX = frozenset({"amx_tile", "amx_int8"})
AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})

# Linux's arch_prctl code (asm/prctl.h) and the tile data's number in the extended state (XFEATURE_XTILEDATA).
SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where there is no such file)."""
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def amx_granted() -> bool | None:
    """Whether Linux grants this process the AMX tile registers, asked as MLAS asks; None where it cannot be
    asked (not x86-64 Linux). False on a kernel before 5.16 (no such request) or where a sandbox refuses it."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0)
    except (OSError, AttributeError):
        return None


def int8_kernel(flags: Iterable[str], amx: bool | None) -> str:
    """The int8 GEMM MLAS picks given the CPU's `flags` and whether the tiles were granted (`amx_granted`)."""
    f = frozenset(flags)
    if AMX.issubset(f) and amx:
        return "AMX"
    if (AVX512_CORE | {"avx512_vnni"}).issubset(f):
        return "AVX-512 VNNI"
    if AVX512_CORE.issubset(f):  # MLAS sets it after AVX-VNNI's, so where both are there it wins
        return "AVX-512"
    if {"avx2", "avx_vnni"}.issubset(f):
        return "AVX-VNNI"
    if "avx2" in f:
        return "AVX2"
    return "other"


def describe(cpuinfo: Path = CPUINFO) -> str:
    """One phrase for logs and reports, e.g. "AMX", or "AVX-512 VNNI (the CPU has AMX, not granted to this
    process)" where a kernel or sandbox kept the tiles from ONNX Runtime."""
    flags = cpu_flags(cpuinfo)
    granted = amx_granted() if AMX.issubset(flags) else None
    kernel = int8_kernel(flags, granted)
    if AMX.issubset(flags) and granted is False:
        return f"{kernel} (the CPU has AMX, not granted to this process)"
    if AMX.issubset(flags) and granted is None:
        return f"{kernel} (the CPU has AMX; whether ONNX Runtime may use it is not known here)"
    return kernel
