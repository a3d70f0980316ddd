"""What mhaserve survives: bad input, overload, deadlines and cancellation, faults, long runs, shutdown.

Each scenario in `scenarios/` (a module per theme) is one function with its sizes as arguments:
`tests/reliability/` runs the short versions in `make test` and asserts on codes, counts and bounds;
`make reliability` (`python -m mhaserve.loadtest.reliability`) runs the long versions and writes
docs/reliability.md with the figures. Traffic goes to 127.0.0.1 only.
"""
