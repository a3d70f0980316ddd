"""The reliability scenarios, one module per theme, each scenario one function whose arguments set its size.

`bad_input` (hypothesis over both APIs), `overload` (a burst past capacity), `deadlines` (expired and
cancelled requests, cancelled streams), `faults` (an engine that raises, hangs, or is stuck for good),
`soak` (a long steady run), `shutdown` (SIGTERM under load, a second signal); `load` holds the closed
and open loops and the requests they send, `common` what every module reads a call's outcome with.

Every scenario returns its figures (requests sent, status codes received, counts before and after)
and asserts nothing itself: `tests/reliability/` asserts on the short runs, `python -m
mhaserve.loadtest.reliability` reports the long ones. None asserts on time; times are reported.
"""
