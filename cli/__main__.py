"""`python -m mhaserve.cli`: the `mhaserve` command."""

import sys

from mhaserve.cli.main import main

sys.exit(main())
