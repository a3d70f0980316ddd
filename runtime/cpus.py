"""The CPUs this process may use: the fewest of its affinity mask's and its cgroup's CPU quota.

`os.cpu_count()` counts the host's cores. In a container limited by a CPU quota (docker `--cpus`, a
Kubernetes `limits.cpu`) that is every core of the node, and ONNX Runtime threads or inference workers
sized by it would take turns on the few cores the quota allows. JVMs and Go's automaxprocs read the same
files for the same reason.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


@functools.cache
def available_cpus(cgroup: Path = CGROUP, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> int:
    """At least 1: the CPUs of the affinity mask, fewer if a cgroup quota allows less (rounded up).

    Read once per process: the settings, the server's shares and every ONNX Runtime session size themselves
    by it at start-up, and must agree."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup, proc_self_cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cgroup_cpu_quota(cgroup: Path = CGROUP, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The tightest CPU quota over this process's cgroup and its parents, in CPUs; None when there is none.

    cgroup v2: `cpu.max` holds "<quota> <period>" or "max <period>". cgroup v1: `cpu.cfs_quota_us` (-1: none)
    over `cpu.cfs_period_us`, under the cpu controller's mount. Inside a container the process's own
    cgroup is usually the mount's root; on a host it is a path below it, read from /proc/self/cgroup.
    """
    quotas = [q for d in _cgroup_dirs(cgroup, proc_self_cgroup) if (q := _quota(d)) is not None]
    return min(quotas) if quotas else None


def _cgroup_dirs(cgroup: Path, proc_self_cgroup: Path) -> list[Path]:
    """The directories that may hold this process's CPU limits, its own cgroup first, then its parents."""
    roots = [cgroup, cgroup / "cpu", cgroup / "cpu,cpuacct"]
    own: list[str] = []
    try:
        for line in proc_self_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "" or "cpu" in controllers.split(","):
                own.append(path.strip("/"))
    except (OSError, ValueError):
        pass
    dirs: list[Path] = []
    for root in roots:
        for path in own:
            d = root / path if path else root
            while True:
                dirs.append(d)
                if d == root:
                    break
                d = d.parent
        dirs.append(root)
    return list(dict.fromkeys(dirs))


def _quota(d: Path) -> float | None:
    try:
        if (d / "cpu.max").is_file():
            quota, period = (d / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (d / "cpu.cfs_quota_us").is_file():
            quota_us = int((d / "cpu.cfs_quota_us").read_text())
            return None if quota_us <= 0 else quota_us / int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None
