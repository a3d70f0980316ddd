"""The bench's HTTP/2 client with its request headers as literals every call (as it sent them before this
session) against the same headers named by index after a connection's first call (as grpc core sends them,
and the client now does): what each costs the server, with its model a scripted engine (each batch sleeps
4 ms, no CPU), so that the server's CPU a request is the work around the model. One client and 32 clients on
one connection, in rounds whose order turns; per point, the server's CPU a request, its event loop's, and the
p50 (one client) or the calls a second (32). Run from the repository root:
    python docs/bench/2026-12-04-fiftyseventh/ab_h2_blocks.py ROUNDS SECONDS
"""

import asyncio
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH / "2026-11-29-twentyeighth"))
sys.path.insert(0, str(BENCH / "2026-11-26-regress"))
from profile_fake import start_fake  # noqa: E402
from regress import workloads_of  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.h2client import METHOD, GrpcH2Transport, RequestBlocks  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402
from mhaserve.service.rpc.lean import frames as f  # noqa: E402


def literal_blocks(authority: str) -> RequestBlocks:
    """The block the client sent before: POST and http from the static table, the rest literals that leave
    the table alone, the same block every call."""
    block = b"\x83\x86" + f.header_block(
        (
            (":path", METHOD),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            ("grpc-timeout", "30S"),
        )
    )
    return RequestBlocks(block, block)


def main(rounds: int, seconds: float) -> None:
    workload = workloads_of(["short"])["short"]
    server, port, http = start_fake([sys.executable], "0.004", [], Path("/tmp/ab-h2-blocks.log"))
    address = f"127.0.0.1:{port}"
    got: dict[str, list[tuple[float, float, float]]] = {}
    try:
        for r in range(rounds):
            ways = ["literal", "indexed"]
            for way in ways[r % 2 :] + ways[: r % 2]:
                for clients in (1, 32):
                    link = transport("grpc", address, f"http://127.0.0.1:{http}", workload, grpc_client="h2")
                    assert isinstance(link, GrpcH2Transport)
                    if way == "literal":
                        link.blocks = literal_blocks(address)
                    raw = asyncio.run(_closed_loop([(link, len(workload.ids))], clients, seconds, 5.0, [server.pid]))
                    group, elapsed = raw["groups"][0], raw["window"][1] - raw["window"][0]
                    n = group["completed"]
                    loop = (raw.get("server_threads_cpu_s") or {}).get("event loop", 0.0)
                    figure = statistics.median(group["latencies"]) if clients == 1 else n / elapsed
                    got.setdefault(f"{way} {clients}", []).append(
                        (raw["server_cpu_s"] / n * 1e6, loop / n * 1e6, figure)
                    )
                    print(r, way, clients, [round(x, 2) for x in got[f"{way} {clients}"][-1]], flush=True)
    finally:
        server.terminate()
        server.wait(30)
    print("medians: server CPU us/request, its event loop's, p50 ms (1 client) or calls/s (32)")
    for name, runs in got.items():
        print(name, [round(statistics.median(x[i] for x in runs), 2) for i in range(3)])
    for clients in (1, 32):
        pairs = zip(got[f"indexed {clients}"], got[f"literal {clients}"], strict=True)
        ratios = [(a[0] / b[0], a[1] / b[1], a[2] / b[2]) for a, b in pairs]
        print(f"indexed / literal, {clients} client(s), each round:", [[round(x, 3) for x in r] for r in ratios])
        print("  medians:", [round(statistics.median(r[i] for r in ratios), 3) for i in range(3)])


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
