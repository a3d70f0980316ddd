"""py-spy on the server's event loop under 32 closed-loop clients (short texts): where its CPU a request goes.

Starts the server as regress.py does, warms up, then records SECONDS of samples of the main thread (py-spy
record --format raw, idle frames left out) while the bench's own client drives PROTOCOL (grpc or http).
Run from the repository root: python docs/bench/2026-11-27-fourteenth/profile32.py PY_SPY SECONDS PROTOCOL OUT
"""

import asyncio
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import start  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402
from mhaserve.loadtest.bench.workloads import build  # noqa: E402
from mhaserve.runtime.repository import ModelRepository  # noqa: E402
from mhaserve.runtime.tokenizer import load_for_serving  # noqa: E402


def main(py_spy: str, seconds: float, protocol: str, out: str) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    workloads = build(["short"], tokenizer, max_seq_len=entry.manifest.max_seq_len, fixed_tokens=128,
                      fixed_pool=64, mixed_pool=256, short_pool=2000)  # fmt: skip
    server, address, url = start(sys.executable, Path("/tmp/profile32-serve.log"))
    try:
        link = transport(protocol, address, url, workloads["short"])
        spy = subprocess.Popen([py_spy, "record", "-p", str(server.pid), "-d", str(int(seconds + 8)), "-r", "250",
                                "-f", "raw", "-o", out, "--threads", "--nonblocking"])  # fmt: skip
        raw = asyncio.run(_closed_loop([(link, len(workloads["short"].ids))], 32, seconds, 8.0, [server.pid]))
        group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
        print(f"{protocol}: {group['completed'] / elapsed:.1f} seq/s over {elapsed:.1f} s", flush=True)
        spy.wait(60)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4])
