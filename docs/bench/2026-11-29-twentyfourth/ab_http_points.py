"""The eighth session's ab_env.py on fewer points: one HTTP client and 32 HTTP clients on short texts, 32 HTTP
clients on mixed texts, and 32 gRPC clients on short texts. Run from the repository root:
  python docs/bench/2026-11-29-twentyfourth/ab_http_points.py ROUNDS SECONDS base= other=ENV:NAME=VALUE
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27-eighth"))
import ab_env  # noqa: E402

ab_env.ab_workers.POINTS = [("short", "http", 1), ("short", "http", 32), ("mixed", "http", 32), ("short", "grpc", 32)]

if __name__ == "__main__":
    ab_env.ab_workers.cli(sys.argv[1:])
