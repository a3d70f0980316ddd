"""`mhaserve serve` as a real process, and what to measure of it (memory, descriptors, threads, live objects).

For what a thread cannot show: signals, exit statuses, a stuck engine, memory over a long run.
"""

from __future__ import annotations

import functools
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from mhaserve.testing.loopback import WAIT, wait_until
from mhaserve.testing.server import health_status

# The fields of /proc/<pid>/status that are plain decimal counts; others of digits alone are hex masks.
STATUS_COUNTS = frozenset({"Pid", "PPid", "Tgid", "Threads", "FDSize", "voluntary_ctxt_switches"})


def parse_status(text: str) -> dict[str, int]:
    """The figures of a /proc/<pid>/status text: every size, in KiB (`VmRSS`, `VmHWM`, `RssAnon`, ...), and
    the counts of STATUS_COUNTS (`Threads`, ...). Names, masks and lists are left out."""
    fields = {}
    for line in text.splitlines():
        key, colon, rest = line.partition(":")
        value = rest.split()
        if (
            colon
            and value
            and value[0].isdigit()
            and (value[1:] == ["kB"] or (key in STATUS_COUNTS and len(value) == 1))
        ):
            fields[key] = int(value[0])
    return fields


def status(pid: int) -> dict[str, int]:
    """`parse_status` of a live process (Linux); OSError when it has gone."""
    return parse_status(Path(f"/proc/{pid}/status").read_text())


@dataclass(frozen=True)
class Memory:
    """A process's memory as the kernel counts it, in KiB: resident now, the peak resident since it started
    (the high-water mark, VmHWM), and the anonymous part of the resident (heap and arenas, not mapped files)."""

    rss_kib: int
    peak_kib: int
    anon_kib: int | None  # RssAnon: Linux 4.5 and later

    @classmethod
    def of(cls, fields: dict[str, int]) -> Memory:
        return cls(fields["VmRSS"], fields["VmHWM"], fields.get("RssAnon"))

    @classmethod
    def total(cls, parts: Sequence[Memory]) -> Memory:
        """Several processes' memory together (the peaks add up as if they came at once: an upper bound)."""
        anon = [m.anon_kib for m in parts]
        return cls(
            sum(m.rss_kib for m in parts),
            sum(m.peak_kib for m in parts),
            None if None in anon else sum(a for a in anon if a is not None),
        )


def memory(pid: int) -> Memory:
    return Memory.of(status(pid))


def children(pid: int, name_prefix: str = "") -> list[int]:
    """The live (not yet reaped) child processes of `pid` whose name starts with `name_prefix`, from /proc
    (Linux): `mhaserve serve --processes` names its server processes mhaserve-p0, mhaserve-p1, ..."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        name, _, rest = stat.partition(" (")[2].rpartition(") ")
        state, ppid = rest.split()[:2]
        if int(ppid) == pid and state != "Z" and name.startswith(name_prefix):
            found.append(int(entry))
    return sorted(found)


@dataclass(frozen=True)
class Sample:
    """One look at a process: seconds since the first look, resident memory, open descriptors, threads."""

    t: float
    rss_kib: int
    fds: int
    threads: int


def sample(pid: int, t0: float) -> Sample:
    """From /proc (Linux)."""
    fields = status(pid)
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return Sample(time.monotonic() - t0, fields["VmRSS"], fds, fields["Threads"])


class ServerProcess:
    """`mhaserve serve` (or the fake-engine server, `engine=` a spec) as a child process, logging to a file."""

    def __init__(
        self,
        flags: Sequence[str],
        log_path: Path,
        *,
        engine: str | None = None,
        env: Mapping[str, str] | None = None,
        files: int | None = None,
    ) -> None:
        """`files`: the child's limit of open files, soft and hard (None: this process's)."""
        if engine is None:
            command = [sys.executable, "-m", "mhaserve.cli", "serve", *flags]
        else:
            command = [sys.executable, "-m", "mhaserve.testing.fake_server", "--engine", engine, *flags]
        self.log_path = log_path
        self._log = log_path.open("w")
        # `env`: the child's whole environment (None: this process's)
        limit = None if files is None else functools.partial(resource.setrlimit, resource.RLIMIT_NOFILE, (files, files))
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, text=True, env=env, preexec_fn=limit
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def port(self, timeout: float = 120.0) -> int:
        found: list[int] = []

        def listening() -> bool:
            found.extend(int(m.group(1)) for m in re.finditer(r"listening on [\d.]+:(\d+)", self.log))
            return bool(found) or self.proc.poll() is not None

        wait_until(listening, "the server to listen", timeout)
        if not found:
            raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log}")
        return found[0]

    def address(self) -> str:
        return f"127.0.0.1:{self.port()}"

    def wait_serving(self, timeout: float = 180.0) -> str:
        address = self.address()

        def serving() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log}")
            with grpc.insecure_channel(address) as channel:
                try:
                    return health_status(channel, timeout=2.0) == "SERVING"
                except grpc.RpcError:
                    return False

        wait_until(serving, "the server to report SERVING", timeout)
        return address

    def signal(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = WAIT) -> int:
        code = self.proc.wait(timeout)
        self._log.close()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT)
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
