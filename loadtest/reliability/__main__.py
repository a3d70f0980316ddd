"""`python -m loadtest.reliability`: see loadtest/reliability/run.py."""

import sys

from loadtest.reliability.run import main

sys.exit(main())
