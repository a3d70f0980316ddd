"""Where the event loop's time goes under N closed-loop clients sending short texts (grpc.aio, or the bench's
HTTP connections with POST /v1/embeddings): py-spy samples the server (defaults, fused graph) without stopping
it, and the main thread's samples are sorted into waiting (epoll), compiled callbacks (a stack that ends in
asyncio's Handle._run: grpc.aio's Cython, or uvicorn's httptools parser, which py-spy cannot see), tokenising,
our own Python, and the rest. Needs py-spy (`pip install py-spy`) and the ptrace permission to attach. Run
from the repository root:
  python docs/bench/2026-11-29-twentyfourth/loop_profile.py CLIENTS SECONDS OUT.raw [grpc|http]
"""

import asyncio
import collections
import subprocess
import sys
from pathlib import Path

from mhaserve.loadtest.bench.client import _closed_loop
from mhaserve.loadtest.bench.transports import transport
from mhaserve.loadtest.bench.workloads import Workload, build
from mhaserve.runtime.repository import ModelRepository
from mhaserve.runtime.tokenizer import load_for_serving
from mhaserve.testing.loopback import free_ports
from mhaserve.testing.process import ServerProcess

OURS = ("EncoderServicer", "interceptors", "dataplane", "pipeline", "batching", "metrics", "service/http", "openai")


def short_texts() -> Workload:
    """The bench's short workload (one text a request), as `mhaserve bench` builds it."""
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    max_seq_len = entry.manifest.max_seq_len
    kw = {"fixed_tokens": 128, "fixed_pool": 64, "mixed_pool": 256, "short_pool": 2000}
    return build(["short"], tokenizer, max_seq_len=max_seq_len, **kw)["short"]


def categories(raw: Path) -> tuple[int, collections.Counter[str]]:
    """The main thread's samples: how many in all, and by category."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if "MainThread" not in frames[0]:
            continue
        rest, leaf = ";".join(frames[1:]), frames[-1]
        if "EpollSelector.select" in leaf:
            kind = "waiting in epoll"
        elif "_tokenize" in rest:
            kind = "tokenising"
        elif any(o in rest for o in OURS):
            kind = "ours: servicer, interceptors, data plane, batcher, metrics"
        elif leaf.startswith("Handle._run"):
            kind = "compiled callbacks (grpc.aio's or httptools')"
        else:
            kind = "other Python (asyncio)"
        counts[kind] += int(n)
    return sum(counts.values()), counts


def main() -> None:
    clients, seconds, out = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    protocol = sys.argv[4] if len(sys.argv) > 4 else "grpc"
    workload = short_texts()
    grpc_port, http_port = free_ports(2)
    flags = ["--repository", "models", "--graph", "optimized", "--port", str(grpc_port), "--http-port", str(http_port)]
    with ServerProcess([*flags, "--metrics-port", "0"], out.with_suffix(".log")) as server:
        address = server.wait_serving()
        link = transport(protocol, address, f"http://127.0.0.1:{http_port}", workload)
        # the bench's closed loop: a warm-up (until every client has had an answer), then a window of `seconds`;
        # py-spy samples `seconds` from the warm-up's start, so the warm-up's second or so and not the window's end
        spy = [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(server.pid), "--nonblocking"]
        spy += ["-d", str(int(seconds)), "-r", "250", "--threads", "-f", "raw", "-o", str(out)]
        sampler = subprocess.Popen(spy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        raw = asyncio.run(_closed_loop([(link, len(workload.ids))], clients, seconds, 3 * seconds, [server.pid]))
        sampler.wait()
        server.signal()
        server.wait()
    group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
    total, counts = categories(out)
    busy = total - counts["waiting in epoll"]
    rate = group["completed"] / elapsed
    print(f"{clients} {protocol} clients: {rate:.1f} requests/s; the main thread's samples {total}, busy {busy}")
    for kind, n in counts.most_common():
        share = "" if kind == "waiting in epoll" else f" ({100 * n / busy:.0f} % of the busy ones)"
        print(f"  {kind}: {n}{share}")


if __name__ == "__main__":
    main()
