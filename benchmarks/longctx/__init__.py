"""Parts of benchmarks/long_context.py: the tiny long-context model (model.py), the measurements
against a running server (measure.py) and the physical limits (limits.py)."""
