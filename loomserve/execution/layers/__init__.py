"""Model layers: attention's entry to the paged KV (attention.py, mla.py), linear-state mixers
(gated_deltanet.py, mamba2.py, state.py), MLPs and experts (mlp.py, moe.py, expert_parallel.py),
norms, rotary embeddings, fused ops, and the linears the CPU and parallel paths need (dense.py,
quant.py, fp8.py, parallel_linear.py).
"""
