"""Execution plane: the scheduler and engine core (in their own process: core_proc.py), the
executor and its workers, model code (models/) and layers (layers/). The messages it
exchanges with the front end are in messages.py. Imports the data plane (kv/), never the
entry points."""
