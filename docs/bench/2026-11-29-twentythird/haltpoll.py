"""One client's p50 against one server (defaults, fused graph), less ONNX Runtime's one text at a time in process,
with the guest kernel's halt polling off (this VM's boot setting, `haltpoll.guest_halt_poll_ns=0`) and on (Linux's
default, 200 us), in alternated rounds. Needs root: it writes /sys/module/haltpoll/parameters/guest_halt_poll_ns
and puts the value it found back at the end. Run from the repository root:
  python docs/bench/2026-11-29-twentythird/haltpoll.py ROUNDS TEXTS [NS ...]
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-twelfth"))
import clients  # noqa: E402
import one_client as oc  # noqa: E402

from mhaserve.testing.process import ServerProcess  # noqa: E402

POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")


def main(rounds: int, n: int, settings: list[int]) -> None:
    texts = oc.SHORT_TEXTS[:n]
    flags, run, every = clients.setup(texts)
    measure = {k: every[k] for k in ("inproc", "aio", "http")}
    found = POLL.read_text().strip()
    rows: dict[int, list[dict[str, float]]] = {ns: [] for ns in settings}
    try:
        with ServerProcess(flags, Path("/tmp/haltpoll-server.log")) as server:
            server.wait_serving()
            oc.p50_ms(run, texts[:20])
            for r in range(rounds):
                for ns in settings[r % len(settings) :] + settings[: r % len(settings)]:
                    POLL.write_text(str(ns))
                    res = {what: measure[what]() for what in measure}
                    rows[ns].append(res)
                    gaps = " ".join(f"{k} {res[k] - res['inproc']:+.2f}" for k in ("aio", "http"))
                    print(f"round {r} poll {ns:>6} ns: in process {res['inproc']:.2f} ms | served - in process: {gaps}",
                          flush=True)  # fmt: skip
    finally:
        POLL.write_text(found)
    for ns in settings:
        med = {k: statistics.median(x[k] for x in rows[ns]) for k in measure}
        gaps = {k: statistics.median(x[k] - x["inproc"] for x in rows[ns]) for k in ("aio", "http")}
        print(f"poll {ns:>6} ns, medians of {rounds}: in process {med['inproc']:.2f} ms, gRPC {med['aio']:.2f} "
              f"({gaps['aio']:+.2f}), HTTP {med['http']:.2f} ({gaps['http']:+.2f})")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), [int(x) for x in sys.argv[3:]] or [0, 200000])
