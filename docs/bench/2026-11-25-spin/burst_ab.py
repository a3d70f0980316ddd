"""Overload burst (the reliability scenario), ORT spinning off vs during runs only: refusal latency, admitted p99."""

import os
import sys
import tempfile
from pathlib import Path

from mhaserve.loadtest.reliability.scenarios.load import queue_texts, text_requests
from mhaserve.loadtest.reliability.scenarios.overload import overload
from mhaserve.testing.loopback import free_ports
from mhaserve.testing.process import ServerProcess

factor = float(sys.argv[1])
rounds = int(sys.argv[2])
wd = Path(tempfile.mkdtemp())
for r in range(rounds):
    for spin in ["off", "run"] if r % 2 == 0 else ["run", "off"]:
        os.environ["X_SPIN"] = spin
        (m,) = free_ports(1)
        flags = [
            "--repository",
            "models",
            "--model",
            "all-minilm-l6-v2",
            "--port",
            "0",
            "--metrics-port",
            str(m),
            "--http-port",
            "0",
            "--device",
            "cpu",
            "--max-queue-size",
            "64",
            "--max-client-batch-size",
            "8",
        ]
        with ServerProcess(flags, wd / f"{spin}.log") as proc:
            addr = proc.wait_serving()
            o = overload(
                addr,
                text_requests(addr, queue_texts(200)),
                max_queue_size=64,
                factor=factor,
                burst_seconds=4.0,
                measure_seconds=3.0,
                clients=8,
                server_codes=lambda: {},
            )
        print(
            f"round {r} spin={spin}: capacity {o.capacity:.0f}/s sent {o.sent} at {o.sent_rate:.0f}/s, "
            f"codes {dict(o.codes)}, lost {o.lost} wrong {o.wrong}, burst OK/s {o.burst_throughput:.0f}, "
            f"refused {o.refused}, admitted {o.admitted}, recovery {o.recovery}",
            flush=True,
        )
