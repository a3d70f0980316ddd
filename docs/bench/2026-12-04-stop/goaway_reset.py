"""How a grpcio client fares against a connection sent away as it connects, closed in one of three ways.

A bare socket server takes one connection, reads the client's preface, and answers as a stopping server with
its grace period spent does: its SETTINGS, a WINDOW_UPDATE, the acknowledgement of the client's SETTINGS, the
first GOAWAY (no stream refused) and its PING; then, `gap` seconds later:
  abort  a reset (SO_LINGER 0), as a close does when the peer's frames arrive after it (grpc core's close; the
         lean front's abort() until 2026-12-04)
  close  a plain close (FIN), nothing of the client's unread
  end    the final GOAWAY (stream 0), our end of the connection (FIN), and reading until the client closes: what
         the lean front does since (Connection.cut)
The listener closes after its one accept, so a client that retries elsewhere is refused: UNAVAILABLE. Any
DEADLINE_EXCEEDED is a call the client kept on the closing connection until its 2 s deadline.

    .venv/bin/python docs/bench/2026-12-04-stop/goaway_reset.py MODE CALLS GAP_S
(2026-12-04, the 2-core Zen 3 machine with two `yes` spinners: abort 5 of 450, close 0 of 150, end 0 of 450.)
"""

import socket
import struct
import sys
import threading
import time

import grpc

from mhaserve.service.rpc.lean import frames as f


def serve(listener: socket.socket, mode: str, gap: float) -> None:
    conn, _ = listener.accept()
    listener.close()
    conn.recv(65536)
    conn.sendall(
        f.settings()
        + f.window_update(0, 1 << 20)
        + f.frame(f.SETTINGS, 1, 0, b"")
        + f.goaway(f.MAX_WINDOW, f.NO_ERROR)
        + f.frame(f.PING, 0, 0, bytes(8))
    )
    time.sleep(gap)
    if mode == "close":
        conn.close()
    elif mode == "abort":
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    else:
        try:
            conn.sendall(f.goaway(0, f.NO_ERROR))
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(1.0)
            while conn.recv(65536):
                pass
        except OSError:
            pass
        conn.close()


def main() -> None:
    mode, calls, gap = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    outcomes: dict[str, int] = {}
    for _ in range(calls):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        threading.Thread(target=serve, args=(listener, mode, gap), daemon=True).start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                channel.unary_unary("/x.Y/Z")(b"", timeout=2)
                outcome = "OK"
            except grpc.RpcError as e:
                outcome = e.code().name
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(mode, gap, outcomes, flush=True)


if __name__ == "__main__":
    main()
