"""CPU per request of a trivial unary handler: grpc.aio server vs sync grpc server (thread pool),
and sync server bridged to an asyncio loop. Client: separate process, grpc.aio, 32 concurrent loops."""

import asyncio
import concurrent.futures
import os
import resource
import sys
import threading
import time
from pathlib import Path

import grpc

REPLY = b"x" * 1600
METHOD = "/t.T/Call"


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def serve(kind, port, ready):
    if kind == "aio":

        async def handler(req, ctx):
            return REPLY

        async def main():
            s = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            s.add_generic_rpc_handlers(
                [grpc.method_handlers_generic_handler("t.T", {"Call": grpc.unary_unary_rpc_method_handler(handler)})]
            )
            s.add_insecure_port(f"127.0.0.1:{port}")
            await s.start()
            ready()
            await s.wait_for_termination()

        asyncio.run(main())
    elif kind.startswith("sync"):
        bridge = kind == "sync-bridge"
        loop = asyncio.new_event_loop()
        if bridge:
            threading.Thread(target=loop.run_forever, daemon=True).start()

        async def work():
            return REPLY

        def handler(req, ctx):  # type: ignore[misc]
            if bridge:
                return asyncio.run_coroutine_threadsafe(work(), loop).result()
            return REPLY

        s = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=int(os.environ.get("W", "40"))),
            options=[("grpc.so_reuseport", 0)],
        )
        s.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("t.T", {"Call": grpc.unary_unary_rpc_method_handler(handler)})]
        )
        s.add_insecure_port(f"127.0.0.1:{port}")
        s.start()
        ready()
        s.wait_for_termination()


async def client(port, n_clients, seconds):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_unary(METHOD)
        stop = time.monotonic() + seconds
        count = 0

        async def loop():
            nonlocal count
            while time.monotonic() < stop:
                await call(b"y" * 200)
                count += 1

        await asyncio.gather(*(loop() for _ in range(n_clients)))
        return count


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve(sys.argv[2], int(sys.argv[3]), lambda: print("ready", flush=True))
    else:
        import socket
        import subprocess

        kind = sys.argv[2]
        n = int(sys.argv[3])
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        p = subprocess.Popen([sys.executable, __file__, "server", kind, str(port)], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        p.stdout.readline()
        asyncio.run(client(port, n, 1.0))  # warm

        def pcpu():
            f = Path(f"/proc/{p.pid}/stat").read_text().split(")")[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

        s0, c0, t0 = pcpu(), cpu(), time.monotonic()
        count = asyncio.run(client(port, n, 6.0))
        dt = time.monotonic() - t0
        s1, c1 = pcpu(), cpu()
        server_ms, client_ms = (s1 - s0) / count * 1e3, (c1 - c0) / count * 1e3
        print(
            f"{kind:12s} clients={n:2d} req/s={count / dt:7.0f} "
            f"server_ms/req={server_ms:.3f} client_ms/req={client_ms:.3f}"
        )
        p.kill()
