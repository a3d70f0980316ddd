"""available_cpus: the affinity mask, cut by a cgroup v1 or v2 CPU quota, read from fake cgroup trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mhaserve.runtime.cpus import available_cpus, cgroup_cpu_quota


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_no_cgroup_files_leaves_the_affinity_mask(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path / "cgroup", tmp_path / "none") is None
    assert available_cpus(tmp_path / "cgroup", tmp_path / "none") == _affinity()


@pytest.mark.parametrize(
    ("cpu_max", "quota", "cap"),
    [("max 100000\n", None, None), ("150000 100000\n", 1.5, 2), ("50000 100000", 0.5, 1)],
)
def test_cgroup_v2_cpu_max_in_a_container(tmp_path: Path, cpu_max: str, quota: float | None, cap: int | None) -> None:
    """In a container the process's cgroup is the mount's root: /proc/self/cgroup says `0::/`. A quota
    of 1.5 CPUs allows 2 threads to run at once, half a CPU still 1."""
    _write(tmp_path / "cgroup" / "cpu.max", cpu_max)
    _write(tmp_path / "self", "0::/\n")
    assert cgroup_cpu_quota(tmp_path / "cgroup", tmp_path / "self") == quota
    want = _affinity() if cap is None else min(_affinity(), cap)
    assert available_cpus(tmp_path / "cgroup", tmp_path / "self") == want


def test_cgroup_v2_on_a_host_takes_the_tightest_quota_over_the_parents(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "system.slice" / "cpu.max", "100000 100000\n")  # 1 CPU for the slice
    _write(root / "system.slice" / "mhaserve.service" / "cpu.max", "400000 100000\n")  # 4 for the service
    _write(root / "other.slice" / "cpu.max", "10000 100000\n")  # not ours
    _write(tmp_path / "self", "0::/system.slice/mhaserve.service\n")
    assert cgroup_cpu_quota(root, tmp_path / "self") == 1.0
    assert available_cpus(root, tmp_path / "self") == 1


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "300000\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "self", "4:cpu,cpuacct:/docker/0123abcd\n3:memory:/docker/0123abcd\n")
    assert cgroup_cpu_quota(root, tmp_path / "self") == 3.0
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")  # no quota
    assert cgroup_cpu_quota(root, tmp_path / "self") is None


def test_a_malformed_file_is_no_quota(tmp_path: Path) -> None:
    _write(tmp_path / "cgroup" / "cpu.max", "garbage\n")
    assert cgroup_cpu_quota(tmp_path / "cgroup", tmp_path / "none") is None
