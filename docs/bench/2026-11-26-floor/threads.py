"""Per thread of each server of floor.py: user and system CPU and wake-ups (schedstat's timeslices) per call.

One client, 200 calls to warm up, then 2,000 timed, as in floor.py (the empty servers' client waits 5 ms
between calls; ours sleep 5 ms in the scripted engine). Threads that did nothing are left out.
Run from the repository root: python docs/bench/2026-11-26-floor/threads.py [KIND ...]
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import floor

TICK = os.sysconf("SC_CLK_TCK")
CALLS = 2000


def per_thread(pid: int) -> dict[tuple[str, str], tuple[float, float, int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            sched = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        name = stat.split("(", 1)[1].rsplit(")", 1)[0]
        fields = stat.rsplit(")", 1)[1].split()
        out[(tid, name)] = (int(fields[11]) / TICK, int(fields[12]) / TICK, int(sched[2]))
    return out


def main(kinds: list[str]) -> None:
    for kind in kinds:
        port, grpc_port = floor.free_port(), floor.free_port()
        server = floor.start(kind, port, grpc_port, Path(f"/tmp/floor-{kind}.log"))
        run = floor.client(kind, port, grpc_port)
        try:
            run(200)
            before = per_thread(server.pid)
            run(CALLS)
            after = per_thread(server.pid)
        finally:
            server.send_signal(2)
            server.wait()
        print(kind)
        for key, (user, system, slices) in after.items():
            if key not in before:
                continue
            du, ds, dw = (now - then for now, then in zip((user, system, slices), before[key], strict=True))
            if du + ds > 0 or dw / CALLS >= 0.05:
                print(f"  {key[1]:16s} user {du / CALLS * 1e6:5.0f} us, system {ds / CALLS * 1e6:4.0f} us, "
                      f"{dw / CALLS:4.2f} wake-ups a call")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:] or floor.KINDS)
