"""ab_workers.py with every gRPC client on a channel (a connection) of its own, so that a server of several
processes (`--processes`) gets its clients spread over them as the kernel spreads connections; every
configuration gets the same clients. The seventh session compared `--processes 2` with the default in three
benches only; this alternates them. Run from the repository root:
  python docs/bench/2026-11-27-eighth/ab_processes.py ROUNDS SECONDS p1= p2=--processes=2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-workers"))
import ab_workers  # noqa: E402

from mhaserve.loadtest.bench import transports  # noqa: E402

shared = ab_workers.transport


def own_channels(protocol, address, url, workload):  # type: ignore[no-untyped-def]
    return shared(protocol, address, url, workload, own_channels=True)


ab_workers.transport = own_channels
assert transports.transport is shared

if __name__ == "__main__":
    ab_workers.cli(sys.argv[1:])
