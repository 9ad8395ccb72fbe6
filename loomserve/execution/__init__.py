"""The worker: one rank's device, weights, paged KV buffer and sampler, turning a scheduled step
(batch.ModelInput) into tokens.

worker.py and model_runner.py, the sampler and logits processors, kv_buffer.py (the KV pages'
memory), memory_profile.py and cuda_graphs.py (GPU), attention/ (backends over the paged KV),
kernels/ (C kernels), layers/, models/ (architectures, registry, loading/), parallel/ (ranks:
TP, DCP, PCP, DEP, the step message, worker processes) and structured/ (grammar masks). Driven
by the engine's executors (loomserve.engine.executor); imports the data plane (kv/) and config,
never the engine. Design: docs/design/attention.md, models.md, parallelism.md.
"""
