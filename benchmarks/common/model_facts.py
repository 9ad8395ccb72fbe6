"""Model facts for rooflines: layer and head counts, parameters and tensor bytes from a GGUF.

`gguf_model_facts` reads a GGUF header (gguf imported lazily); `roofline` is the
bandwidth-bound ceiling of batched decode:
    bytes/step = W + C * ctx * kv_bytes_per_token;  tok/s <= C * BW / bytes/step.

Invariant: tied embeddings are counted once (the table is read again as the LM head, within the
same step's weight bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelFacts", "gguf_model_facts", "roofline"]


@dataclass
class ModelFacts:
    """What a roofline needs to know about a Llama-family model."""
    arch: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    n_params: int  # distinct parameters (tied embeddings counted once)
    file_tensor_bytes: int  # bytes of all tensors as stored in the file (quantised)
    tied_embeddings: bool

    def weight_bytes(self, dtype_bytes: float | None) -> int:
        """Bytes of weights read per decode step: every parameter once (with tied
        embeddings, the table is read as the LM head). ``None`` = as stored in the file."""
        if dtype_bytes is None:
            return self.file_tensor_bytes
        return int(self.n_params * dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: float) -> int:
        """K and V bytes of one cached position, all layers."""
        return int(self.n_layers * 2 * self.n_kv_heads * self.head_dim * dtype_bytes)


def gguf_model_facts(path: str) -> ModelFacts:
    """Read layer/head counts and the parameter count from a GGUF file's header."""
    import numpy as np
    from gguf import GGUFReader

    r = GGUFReader(path)

    def field_value(key: str, default: Any = None) -> Any:
        f = r.fields.get(key)
        if f is None:
            return default
        part = f.parts[f.data[0]]
        if len(f.types) and f.types[0].name == "STRING":
            return bytes(part).decode()
        return part.tolist()[0] if hasattr(part, "tolist") else part

    arch = field_value("general.architecture", "llama")
    n_layers = int(field_value(f"{arch}.block_count"))
    n_heads = int(field_value(f"{arch}.attention.head_count"))
    n_kv = int(field_value(f"{arch}.attention.head_count_kv", n_heads))
    hidden = int(field_value(f"{arch}.embedding_length"))
    head_dim = int(field_value(f"{arch}.attention.key_length", hidden // n_heads))
    n_params = 0
    file_bytes = 0
    names = set()
    vocab = 0
    for t in r.tensors:
        n_params += int(np.prod([int(x) for x in t.shape]))
        file_bytes += int(t.n_bytes)
        names.add(t.name)
        if t.name == "token_embd.weight":
            vocab = int(max(int(x) for x in t.shape))
    return ModelFacts(arch=arch, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
                      head_dim=head_dim, hidden=hidden, vocab=vocab, n_params=n_params,
                      file_tensor_bytes=file_bytes, tied_embeddings="output.weight" not in names)


def roofline(bandwidth_gbs: float, weight_bytes: int, kv_bytes_per_token: int,
             ctx_per_stream: float, concurrency: int) -> dict[str, float]:
    """Bandwidth-bound ceiling for batched decode.

    One decode step reads all weights once plus every stream's KV cache up to its context:
    bytes/step = W + C * ctx * kv_bytes_per_token; steps/s <= BW / bytes/step;
    tokens/s <= C * steps/s.
    """
    step_bytes = weight_bytes + concurrency * ctx_per_stream * kv_bytes_per_token
    steps = bandwidth_gbs * 1e9 / step_bytes
    return {"bytes_per_step": float(step_bytes), "max_steps_per_s": steps,
            "max_tok_per_s": steps * concurrency}
