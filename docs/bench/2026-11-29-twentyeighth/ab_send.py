"""The lean front sending what a turn of the event loop writes in one send against the code without it
(5bca904), in alternated rounds, both with `--grpc-front lean`. Measured and not taken (twenty-eighth session):
the change is one-send.patch beside this script; apply it to this tree (a checkout of 5bca904 or later) to
run this again.

BASE is a checkout of 5bca904 installed in a venv of its own (as in ab_beside.py); the load generator is
this tree's for both, the bench's h2 client. (The run recorded in ab-send.txt had the h2 client gathering
its writes the same way, in both arms; not kept, as it was not measured on its own.)
Points: short texts at 32 gRPC clients on one connection (texts a second; the CPU a request of the server,
its event loop and the client), and one client (p50). Run from the repository root:
    python docs/bench/2026-11-29-twentyeighth/ab_send.py /tmp/base/.venv/bin/python ROUNDS SECONDS
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
import regress  # noqa: E402
from ab_beside import measure  # noqa: E402

FLAGS = ("--graph", "auto", "--grpc-front", "lean")
POINTS = [("short", "grpc", 32), ("short", "grpc", 1)]


def main(base: str, rounds: int, seconds: float) -> None:
    workloads = regress.workloads_of(["short"])

    def one(python: str) -> dict[str, float]:
        return measure(python, workloads, seconds, FLAGS, POINTS, grpc_client="h2")

    rows = regress.alternate({"base": lambda: one(base), "one-send": lambda: one(sys.executable)}, rounds)
    regress.print_ratios(rows, "base", "one-send", rounds)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
