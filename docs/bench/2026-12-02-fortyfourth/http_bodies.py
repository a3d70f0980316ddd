"""What HTTP clients that never finish their request bodies make a server hold (2026-12-02).

    .venv/bin/python docs/bench/2026-12-02-fortyfourth/http_bodies.py 200 2
    .venv/bin/python docs/bench/2026-12-02-fortyfourth/http_bodies.py 200 2 --max-incoming-bytes 1099511627776

Run from the repository's root, after `make install-dev` and an export into models/ (the README). Starts
`mhaserve serve` (a scripted engine: no model runs) on free ports; CONNECTIONS connections each send the
headers of a POST /v1/embeddings whose Content-Length says 4 MiB and MIB MiB of its body, then nothing. Prints
the server's RSS (from /proc) before, while they are open, and after the read timeout (--http-header-timeout,
10 s), and what the connections were answered. Flags after the numbers go to `mhaserve serve` (a limit of 1 TiB
is what the server held before --max-incoming-bytes).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, ".")
from mhaserve.testing.loopback import free_ports  # noqa: E402
from mhaserve.testing.process import ServerProcess, status  # noqa: E402


def rss(pid: int) -> int:
    return status(pid)["VmRSS"] // 1024


def answer(s: socket.socket) -> str:
    """The status line's code, or what became of the connection."""
    try:
        head = s.recv(64)
    except TimeoutError:
        return "no answer yet"
    except ConnectionResetError:
        return "reset"
    return head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/1.1 ") else "closed"


def main(connections: int, mib: float, extra: list[str]) -> None:
    grpc_port, http_port, metrics_port = free_ports(3)
    flags = ["--repository", "models", "--model", "all-minilm-l6-v2", "--port", str(grpc_port), "--http-port",
             str(http_port), "--metrics-port", str(metrics_port), *extra]  # fmt: skip
    with ServerProcess(flags, Path("/tmp/http_bodies.log"), engine="") as p:
        p.wait_serving()
        time.sleep(1)
        before = rss(p.pid)
        head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {4 << 20}\r\n\r\n".encode()
        body = b" " * int(mib * (1 << 20))
        sockets = []
        began = time.monotonic()
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", http_port), timeout=30)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # answered and closed while it sent
                s.sendall(head + body)
            sockets.append(s)
        time.sleep(1)
        held = rss(p.pid)
        for s in sockets:
            s.settimeout(0.01)
        early = Counter(answer(s) for s in sockets)
        print(f"{connections} connections, {mib:g} MiB of a 4 MiB body each, sent in {time.monotonic() - began:.1f} s")
        print(f"  RSS {before} -> {held} MiB; answered so far: {dict(early)}")
        time.sleep(12)
        for s in sockets:
            s.settimeout(1)
        late = Counter(answer(s) for s in sockets)
        print(f"  12 s later: RSS {rss(p.pid)} MiB; answers: {dict(late)}")
        for s in sockets:
            s.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:])
