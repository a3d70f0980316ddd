"""cProfile on the event loop of a server whose model is a scripted engine (each batch sleeps 10 ms, no CPU),
the lean gRPC front, under 32 closed-loop clients of the bench's h2 client (or HTTP) on the short texts for
15 s: the loop's work a request by function, deterministic where py-spy's samples were not (native frames
read larger than they cost). cProfile slows Python about twofold; compare functions with each other.
Run from the repository root, then read OUT with pstats:
    python docs/bench/2026-11-29-twentyeighth/cprofile_fake.py PROTOCOL OUT
"""

import asyncio
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from profile_fake import start_fake  # noqa: E402
from regress import workloads_of  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402


def main(protocol: str, out: str) -> None:
    workloads = workloads_of(["short"])
    python = [sys.executable, "-m", "cProfile", "-o", out]
    server, port, http = start_fake(python, "0.01", ["--grpc-front", "lean"], Path("/tmp/cprofile-fake-serve.log"))
    try:
        link = transport(protocol, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", workloads["short"],
                         grpc_client="h2")  # fmt: skip
        raw = asyncio.run(_closed_loop([(link, len(workloads["short"].ids))], 32, 15.0, 5.0, [server.pid]))
        print("requests", raw["groups"][0]["completed"])
    finally:
        server.send_signal(signal.SIGTERM)  # a drain, then a normal exit: cProfile writes OUT
        server.wait(60)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
