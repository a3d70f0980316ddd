"""`mhaserve serve` with a scripted engine, as a real process: `python -m mhaserve.testing.fake_server
--engine slow:0.05,hang:99 --repository R --model M ...` (every serve flag). For the scenarios that need
a process to signal (shutdown, a second signal, a stuck engine) and an engine that misbehaves on cue.
SIGUSR1 releases a hanging batch, so a test decides when it ends instead of racing a fixed hang.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from mhaserve.cli.options import add_arguments, build
from mhaserve.service.context import configure_logging
from mhaserve.service.server import serve
from mhaserve.testing.engines import parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhaserve.testing.fake_server")
    parser.add_argument("--engine", default="", help="slow:SECONDS, fail:ID, hang:ID[:SECONDS], comma-separated")
    add_arguments(parser)
    args = parser.parse_args(argv)
    settings = build(args)
    configure_logging(settings.log_level)
    engine = parse(args.engine)
    engine.record = False
    # A Python-level handler: it runs on the main thread between the event loop's steps, and setting the
    # event wakes the inference thread waiting in ScriptedEngine.run.
    signal.signal(signal.SIGUSR1, lambda _sig, _frame: engine.release.set())
    return asyncio.run(serve(settings, engine_factory=engine.factory()))


if __name__ == "__main__":
    sys.exit(main())
