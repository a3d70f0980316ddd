"""`python -m mhaserve.cli`: the `mhaserve` command."""

import sys

from mhaserve.cli.main import main

# Guarded: a process that `serve --processes` spawns imports this module again (as __mp_main__).
if __name__ == "__main__":
    sys.exit(main())
