"""Session-wide test setup.

Without CUDA, the Triton attention kernels run under Triton's interpreter. The switch must be
on before anything imports triton: triton binds its own @jit helpers (tl.zeros, tl.max, ...)
at import, and an interpreted kernel cannot call a compiled helper. Child processes the tests
start inherit it; they run no Triton code on a CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
