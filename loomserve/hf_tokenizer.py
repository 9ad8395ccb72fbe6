"""Loading a model folder's Hugging Face tokenizer, shared by the front end (text in and out)
and the engine core (the grammar compiler's vocabulary), so neither plane imports the other."""

from __future__ import annotations


def load_hf_tokenizer(folder: str):
    """The fast tokenizer of `folder`, offline. A tokenizer_class transformers can't resolve
    offline falls back to tokenizer.json, which is enough."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception:
        return PreTrainedTokenizerFast.from_pretrained(folder)
