"""loomserve's benchmarks: scripts run as files (`python benchmarks/decode_throughput.py`, with
benchmarks/ on sys.path for `common`), and the report (`python -m benchmarks.report`), which
writes docs/benchmarks.md from benchmarks/results/."""
