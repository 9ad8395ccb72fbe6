"""Multi-process execution: process groups (state), the per-step broadcast (step_message), worker
processes (worker_proc), the executor the engine core drives (multiproc_executor), and tensor
parallelism for every registered family (tensor_parallel, tp_families; layers in
layers/parallel_linear.py)."""
