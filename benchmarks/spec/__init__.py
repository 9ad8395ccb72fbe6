"""The speculative-decoding benchmark's agent-shaped workload (benchmarks/spec_decode.py)."""
