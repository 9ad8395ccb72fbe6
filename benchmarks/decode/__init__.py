"""The systems and prompts of benchmarks/decode_throughput.py (imported with benchmarks/ on
sys.path).

    prompts.py      fresh fixed-length token-id prompts (no prefix can be reused)
    served.py       an OpenAI-compatible server as a system: loomserve, llama-server argv
    hf_generate.py  transformers' generate() on the dequantised weights as a system

Every system has the same two methods: `warm_up(prompts)` and
`measure(prompts, max_tokens, label) -> DecodeMeasurement`, so the interleaved loop treats
servers and in-process systems alike.
"""
