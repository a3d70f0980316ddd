"""How long the inference thread waits for the GIL when its batch ends, under load.

The server with the scripted engine (5 ms asleep a batch, as ONNX Runtime runs without the GIL), with its
`time.sleep` timed from inside: how far past 5 ms each batch's sleep returns. Alone, that is the timer's
lateness; under 32 clients, what is added is the wait for the GIL, held meanwhile by the event loop
(the hand-back of a batch, and so the start of the next, waits as long). With SWITCH=seconds the server
runs with `sys.setswitchinterval(seconds)` (Python's default: 0.005).

`python gil_wait.py serve [fake_server flags]` is the server (it writes the lateness to $GIL_OUT at
exit); `python gil_wait.py ROUNDS SECONDS SWITCH...` alternates the switch intervals in rounds, each
at one client (500 calls) and at 32 clients (SECONDS), over HTTP. Run from the repository root.
"""

import asyncio
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import floor
import floor_load


def serve() -> None:
    from mhaserve.testing import engines
    from mhaserve.testing.fake_server import main

    late: list[float] = []
    sleep = time.sleep

    def timed_sleep(seconds: float) -> None:
        t0 = time.perf_counter()
        sleep(seconds)
        late.append(time.perf_counter() - t0 - seconds)

    # The engine's module sees this `time`: the real one but for its sleep.
    names = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    engines.time = types.SimpleNamespace(**{**names, "sleep": timed_sleep})  # type: ignore[assignment]
    if os.environ.get("SWITCH"):
        sys.setswitchinterval(float(os.environ["SWITCH"]))
    try:
        main(sys.argv[2:])
    finally:
        Path(os.environ["GIL_OUT"]).write_text("\n".join(f"{x:.7f}" for x in late))


def measure(switch: str, seconds: float) -> dict[str, float]:
    port, grpc_port = floor.free_port(), floor.free_port()
    out = Path(f"/tmp/gil-wait-{switch}.txt")
    flags = ["--engine", "slow:0.005", "--repository", "models", "--metrics-port", "0",
             "--port", str(grpc_port), "--http-port", str(port)]  # fmt: skip
    env = {**os.environ, "GIL_OUT": str(out), **({"SWITCH": switch} if switch != "default" else {})}
    with Path(f"/tmp/gil-wait-{switch}.log").open("w") as log:
        server = subprocess.Popen(
            [sys.executable, __file__, "serve", *flags], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    while "serving all-minilm" not in Path(f"/tmp/gil-wait-{switch}.log").read_text():
        assert server.poll() is None
        time.sleep(0.2)
    time.sleep(1)
    one = floor.http_client(port, 500, 0.0)
    calls = asyncio.run(floor_load.load("http-ours", port, grpc_port, seconds))
    server.send_signal(2)
    server.wait()
    late = [float(x) for x in out.read_text().split()]
    lone, loaded = late[: len(one)], late[len(one) :]  # one batch a call at one client, then the load
    return {
        "lone late p50 us": 1e6 * statistics.median(lone),
        "loaded late p50 us": 1e6 * statistics.median(loaded),
        "loaded late p90 us": 1e6 * statistics.quantiles(loaded, n=10)[-1],
        "32 clients /s": calls / seconds,
        "one client p50 ms": 1000 * statistics.median(one) - 5,
    }


def main() -> None:
    rounds, seconds, switches = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    rows: dict[str, list[dict[str, float]]] = {s: [] for s in switches}
    for r in range(rounds):
        for s in switches if r % 2 == 0 else list(reversed(switches)):
            rows[s].append(measure(s, seconds))
            print(f"round {r} switch {s}: " + ", ".join(f"{k} {v:.1f}" for k, v in rows[s][-1].items()), flush=True)
    print("medians:")
    for s, got in rows.items():
        print(f"  switch {s}: " + ", ".join(f"{k} {statistics.median(g[k] for g in got):.1f}" for k in got[0]))


if __name__ == "__main__":
    serve() if sys.argv[1] == "serve" else main()
