"""The eleventh session's profile_loop.py with CLIENTS closed-loop clients (1: a lone request's path) in place of
its 32: py-spy records the server's event loop while the clients send the short texts over gRPC or HTTP.
Run from the repository root:
  python docs/bench/2026-11-27-twelfth/profile_lone.py SECONDS grpc|http CLIENTS OUT.txt
"""

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eleventh"))
import profile_loop  # noqa: E402

from mhaserve.loadtest.bench import client  # noqa: E402

if __name__ == "__main__":
    clients = int(sys.argv[3])

    async def closed_loop(loads: Any, _: int, *rest: Any) -> dict[str, Any]:
        raw = await client._closed_loop(loads, clients, *rest)
        n = raw["groups"][0]["completed"]
        per = {k: round(1000 * v / n, 3) for k, v in (raw["server_threads_cpu_s"] or {}).items()}
        print(f"{clients} client(s); ms of CPU a request by thread: {per}")
        return raw

    profile_loop._closed_loop = closed_loop  # type: ignore[assignment]
    profile_loop.main(float(sys.argv[1]), sys.argv[2], Path(sys.argv[4]))
