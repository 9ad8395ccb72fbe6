"""Weights in: loader.py (load_model: an HF folder, a .gguf file or the built-in default
model, default.py), checkpoint.py (safetensors, FP8 checkpoints), gguf.py (GGUF -> a cached HF
folder), gguf_quant.py (GGUF blocks -> quantized linears), hub.py (hub ids -> files in
huggingface_hub's cache), weight_layout.py (CPU weight layouts
chosen after loading). Design: docs/design/models.md.
"""
