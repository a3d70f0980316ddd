"""`python -m mhaserve.loadtest.reliability`: see loadtest/reliability/run.py."""

import sys

from mhaserve.loadtest.reliability.run import main

sys.exit(main())
