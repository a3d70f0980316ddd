"""What a client's request can make a server hold in memory, on either gRPC front (2026-12-01).

    .venv/bin/python docs/bench/2026-12-01-fortythird/request_memory.py bomb lean 60
    .venv/bin/python docs/bench/2026-12-01-fortythird/request_memory.py partial grpc 200 2
    .venv/bin/python docs/bench/2026-12-01-fortythird/request_memory.py partial lean 200 2 --max-incoming-bytes 33554432

Run from the repository's root, after `make install-dev` and an export into models/ (the README). Each starts
`mhaserve serve` (a scripted engine: no model runs) on a free port and reads its memory from /proc:

- `bomb FRONT MIB`: one Encode call whose message is MIB MiB of zeros, gzipped (about 1,000-fold smaller);
  the server's peak RSS (VmHWM) before and after, and what the call read.
- `partial FRONT STREAMS MIB`: STREAMS calls on one connection, each MIB MiB into a message that declares
  4 MiB and is never finished (flow control respected); the server's RSS while they are open, 12 s later
  (past --http-header-timeout, 10 s), and once the connection has closed; how many calls were answered before
  they ended (2026-12-02: refused at --max-incoming-bytes, or failed as too slow). Flags after the numbers go to
  `mhaserve serve`.
"""

from __future__ import annotations

import gzip
import select
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, ".")
from mhaserve.service.rpc.lean import frames as f  # noqa: E402
from mhaserve.testing.process import ServerProcess, status  # noqa: E402
from tests.service.raw_h2 import call_block, read_frames  # noqa: E402

ENCODE = "/encoder.v1.EncoderService/Encode"


def mib_of(pid: int, key: str) -> int:
    """A /proc/PID/status line's value (VmRSS, VmHWM), in MiB."""
    return status(pid)[key] // 1024


@contextmanager
def server(front: str, extra: list[str] | None = None) -> Iterator[tuple[int, int]]:
    """(pid, port) of a server on `front` (a scripted engine), serving; its log in /tmp."""
    flags = ["--repository", "models", "--model", "all-minilm-l6-v2", "--port", "0", "--http-port", "0",
             "--metrics-port", "0", "--grpc-front", front, *(extra or [])]  # fmt: skip
    with ServerProcess(flags, Path(f"/tmp/request_memory-{front}.log"), engine="") as p:
        address = p.wait_serving()
        time.sleep(1)
        yield p.pid, int(address.rpartition(":")[2])


def bomb(front: str, mib: int) -> None:
    payload = gzip.compress(bytes(mib << 20), 9)
    message = b"\x01" + len(payload).to_bytes(4, "big") + payload
    with server(front) as (pid, port):
        before = mib_of(pid, "VmHWM")
        with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
            frames = [f.frame(f.HEADERS, f.END_HEADERS, 1, call_block(ENCODE, ("grpc-encoding", "gzip")))]
            chunks = [message[i : i + f.DEFAULT_MAX_FRAME] for i in range(0, len(message), f.DEFAULT_MAX_FRAME)]
            frames += [f.frame(f.DATA, f.END_STREAM * (i == len(chunks) - 1), 1, c) for i, c in enumerate(chunks)]
            raw.sendall(f.PREFACE + f.settings() + b"".join(frames))
            got = read_frames(raw, 5)
        answer = [p for k, _, _, p in got if k == f.HEADERS][-1:]
        print(f"{front}: {len(payload)} bytes inflating to {mib} MiB; peak RSS {before} -> {mib_of(pid, 'VmHWM')} MiB;")
        print(f"  its trailers: {answer}")


def partial(front: str, streams: int, mib: float, extra: list[str]) -> None:
    target = int(mib * (1 << 20))
    answered = 0
    with server(front, extra) as (pid, port):
        before = mib_of(pid, "VmRSS")
        s = socket.create_connection(("127.0.0.1", port))
        s.setblocking(False)
        out = bytearray(f.PREFACE + f.settings())
        initial, window = f.DEFAULT_WINDOW, f.DEFAULT_WINDOW  # a new stream's, and the connection's
        sent: dict[int, int] = {}
        windows: dict[int, int] = {}
        for i in range(streams):
            out += f.frame(f.HEADERS, f.END_HEADERS, 2 * i + 1, call_block(ENCODE))
            sent[2 * i + 1] = 0
        buf = bytearray()
        deadline = time.time() + 30
        while time.time() < deadline and (out or any(n < target for n in sent.values())):
            readable, writable, _ = select.select([s], [s] if out else [], [], 0.05)
            if readable:
                chunk = s.recv(1 << 20)
                if not chunk:
                    print("the server closed the connection")
                    break
                buf += chunk
                for kind, flags, stream, payload in f.whole_frames(buf):
                    if kind == f.SETTINGS and not flags & f.ACK:
                        for j in range(0, len(payload), 6):
                            if int.from_bytes(payload[j : j + 2], "big") == f.INITIAL_WINDOW_SIZE:
                                value = int.from_bytes(payload[j + 2 : j + 6], "big")
                                windows = {k: w + value - initial for k, w in windows.items()}
                                initial = value
                        out += f.frame(f.SETTINGS, f.ACK, 0)
                    elif kind == f.WINDOW_UPDATE and stream == 0:
                        window += int.from_bytes(payload, "big")
                    elif kind == f.WINDOW_UPDATE:
                        windows[stream] = windows.get(stream, initial) + int.from_bytes(payload, "big")
                    elif kind == f.PING and not flags & f.ACK:
                        out += f.frame(f.PING, f.ACK, 0, payload)
                    elif kind in (f.RST_STREAM, f.HEADERS):
                        answered += kind == f.HEADERS and stream in sent
                        sent.pop(stream, None)
            for stream, n in sent.items():
                room = min(f.DEFAULT_MAX_FRAME, windows.get(stream, initial), window, target - n)
                if len(out) > (1 << 20) or room <= 0:
                    continue
                data = bytearray(room)
                if n == 0:  # the message's prefix: uncompressed, 4 MiB long
                    data[:5] = b"\x00" + (4 << 20).to_bytes(4, "big")
                out += f.frame(f.DATA, 0, stream, bytes(data))
                sent[stream] += room
                windows[stream] = windows.get(stream, initial) - room
                window -= room
            if writable and out:
                del out[: s.send(out)]
        time.sleep(2)
        held = mib_of(pid, "VmRSS")
        print(f"{front}: {len(sent)} calls open, {sum(sent.values()) >> 20} MiB sent; RSS {before} -> {held} MiB")
        print(f"  {answered} calls answered while the client sent")
        time.sleep(12)
        s.setblocking(True)
        s.settimeout(1)
        late = read_frames(s, 1)
        late_answers = sum(kind == f.HEADERS for kind, *_ in late)
        print(f"  12 s later: RSS {mib_of(pid, 'VmRSS')} MiB; {late_answers} more calls answered")
        s.close()
        time.sleep(2)
        print(f"{front}: once the connection closed, RSS {mib_of(pid, 'VmRSS')} MiB")


if __name__ == "__main__":
    what, front, *numbers = sys.argv[1:]
    if what == "bomb":
        bomb(front, int(numbers[0]))
    else:
        partial(front, int(numbers[0]), float(numbers[1]), numbers[2:])
