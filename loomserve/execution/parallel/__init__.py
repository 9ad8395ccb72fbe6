"""Multi-process execution: process groups (state), the per-step broadcast (step_message), worker
processes (worker_proc; the executor that drives them is engine/executor/multiproc.py), tensor
parallelism's machinery (tensor_parallel: each model class declares its own split; layers in
layers/parallel_linear.py), decode and prefill context parallelism (context_parallel,
prefill_context_parallel), MoE cores in lockstep (dp_lockstep) and the ranks' one KV pool
(shared_pool)."""
