"""int8_kernels: the int8 GEMM ONNX Runtime's MLAS picks, from the CPU's flags and the AMX grant, in MLAS's order."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from mhaserve.runtime import int8_kernels
from mhaserve.runtime.int8_kernels import amx_granted, cpu_flags, describe, int8_kernel

AVX512 = "avx2 avx512f avx512bw avx512dq avx512vl"
SAPPHIRE_RAPIDS = f"{AVX512} avx512_vnni avx_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse {flags}\n\nprocessor\t: 1\n")
    return path


@pytest.mark.parametrize(
    ("flags", "amx", "kernel"),
    [
        (SAPPHIRE_RAPIDS, True, "AMX"),
        (SAPPHIRE_RAPIDS, False, "AVX-512 VNNI"),  # tiles refused: MLAS falls back to VNNI
        (f"{AVX512} avx512_vnni", None, "AVX-512 VNNI"),  # Zen 4, Cascade Lake
        ("avx2 avx_vnni", None, "AVX-VNNI"),  # Alder Lake's cores
        (AVX512, None, "AVX-512"),  # Skylake-SP
        (f"{AVX512} avx_vnni", None, "AVX-512"),  # MLAS's AVX-512 choice comes after, and over, AVX-VNNI's
        ("avx2 fma", None, "AVX2"),  # Zen 3
        ("sse4_2", None, "other"),
        ("amx_tile amx_int8 avx2", False, "AVX2"),
    ],
)
def test_the_kernel_follows_mlas_order(flags: str, amx: bool | None, kernel: str) -> None:
    assert int8_kernel(flags.split(), amx) == kernel


def test_the_flags_are_the_first_cpus(tmp_path: Path) -> None:
    flags = cpu_flags(_cpuinfo(tmp_path, "avx2 avx512_vnni"))
    assert {"fpu", "sse", "avx2", "avx512_vnni"} == flags
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_describe_says_when_amx_is_there_but_not_granted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = _cpuinfo(tmp_path, SAPPHIRE_RAPIDS)
    monkeypatch.setattr(int8_kernels, "amx_granted", lambda: True)
    assert describe(info) == "AMX"
    monkeypatch.setattr(int8_kernels, "amx_granted", lambda: False)
    assert describe(info) == "AVX-512 VNNI (the CPU has AMX, not granted to this process)"
    monkeypatch.setattr(int8_kernels, "amx_granted", lambda: None)
    assert describe(info).startswith("AVX-512 VNNI (the CPU has AMX; whether")


def test_describe_asks_for_tiles_only_where_the_cpu_has_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> bool:
        raise AssertionError("asked the kernel for AMX on a CPU without it")

    monkeypatch.setattr(int8_kernels, "amx_granted", refuse)
    assert describe(_cpuinfo(tmp_path, "avx2 fma")) == "AVX2"


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="asks Linux on x86-64")
def test_the_grant_is_asked_of_this_kernel() -> None:
    # On a CPU without AMX the request fails (False); with AMX on Linux 5.16+ it is granted (True): a bool,
    # never None, here. The CPU's own flags say which to expect unless a sandbox refuses it.
    granted = amx_granted()
    assert isinstance(granted, bool)
    if not int8_kernels.AMX.issubset(cpu_flags()):
        assert granted is False
