"""CPU of each of the server's threads, one by one (not by role), under 32 closed-loop clients of the short texts
for SECONDS, the server started with FLAGS. Names the threads that the bench report lumps together as `other`.
Run from the repository root:
  python docs/bench/2026-11-27-ninth/thread_cpu.py SECONDS grpc|http [FLAGS...]
"""

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-26-regress"))
from regress import free_ports  # noqa: E402

from mhaserve.loadtest.bench.client import _closed_loop  # noqa: E402
from mhaserve.loadtest.bench.quiet import TICKS  # noqa: E402
from mhaserve.loadtest.bench.transports import transport  # noqa: E402
from mhaserve.loadtest.bench.workloads import build  # noqa: E402
from mhaserve.runtime.repository import ModelRepository  # noqa: E402
from mhaserve.runtime.tokenizer import load_for_serving  # noqa: E402


def threads(pid: int) -> dict[tuple[int, str], float]:
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[(int(task.name), name)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def main(seconds: float, protocol: str, flags: list[str]) -> None:
    entry = ModelRepository(Path("models")).entry("all-minilm-l6-v2", graph="optimized")
    tokenizer = load_for_serving(entry.tokenizer_path, entry.manifest.max_seq_len)
    workload = build(["short"], tokenizer, max_seq_len=entry.manifest.max_seq_len, fixed_tokens=128,
                     fixed_pool=64, mixed_pool=256, short_pool=2000)["short"]  # fmt: skip
    port, metrics, http = free_ports(3)
    log = Path("/tmp/serve-thread-cpu.log")
    # With TRACE set, the server records its engine runs there (traced_serve.py of the eighth session).
    traced = Path(__file__).resolve().parents[1] / "2026-11-27-eighth" / "traced_serve.py"
    entry_point = [str(traced)] if os.environ.get("TRACE") else ["-m", "mhaserve.cli.main"]
    cmd = [sys.executable, *entry_point, "serve", "--repository", "models", "--graph", "optimized",
           "--port", str(port), "--metrics-port", str(metrics), "--http-port", str(http), *flags]  # fmt: skip
    with log.open("w") as out:
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    while not re.search(r"serving all-minilm\S* version \d+ .*after", log.read_text()):
        if server.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.2)
    time.sleep(1)
    link = transport(protocol, f"127.0.0.1:{port}", f"http://127.0.0.1:{http}", workload)
    before = threads(server.pid)
    raw = asyncio.run(_closed_loop([(link, len(workload.ids))], 32, seconds, 3 * seconds, [server.pid]))
    after = threads(server.pid)
    server.terminate()
    server.wait(60)
    done = raw["groups"][0]["completed"]
    print(f"{protocol} {' '.join(flags)}: {done} requests; CPU ms a request by thread:")
    for key in sorted(after, key=lambda k: before.get(k, 0.0) - after[k]):
        ms = 1000 * (after[key] - before.get(key, 0.0)) / done
        if ms >= 0.005:
            print(f"  {key[0]:>8} {key[1]:<16} {ms:6.3f}")


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], [f for f in sys.argv[3:] if f])
