"""`mhaserve serve` with a scripted engine, as a real process: `python -m loadtest.reliability.fake_server
--engine slow:0.05,hang:99 --repository R --model M ...` (every serve flag). For the scenarios that need
a process to signal (shutdown, a second signal, a stuck engine) and an engine that misbehaves on cue.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from loadtest.reliability.engines import parse
from service import settings as st
from service.interceptors import RequestIdFilter
from service.server import serve


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.reliability.fake_server")
    parser.add_argument("--engine", default="", help="slow:SECONDS, fail:ID, hang:ID[:SECONDS], comma-separated")
    st.add_arguments(parser)
    args = parser.parse_args(argv)
    settings = st.build(args)
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)
    engine = parse(args.engine)
    engine.record = False
    return asyncio.run(serve(settings, engine_factory=engine.factory()))


if __name__ == "__main__":
    sys.exit(main())
