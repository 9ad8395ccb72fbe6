"""Prompts of the decode benchmark: `count` prompts of exactly PROMPT_LEN token ids.

Each prompt leads with its own topic and number, so no two prompts of a run share even their
first tokens, and prompts are numbered on across rounds: neither prefix caching nor prompt reuse
can help any system.

Invariant: every prompt has exactly `length` ids (the filler is repeated, then cut).
"""

from __future__ import annotations

import os

__all__ = ["PROMPT_LEN", "load_tokenizer", "make_prompts"]

PROMPT_LEN = 32

_TOPICS = [
    "a lighthouse keeper", "the history of glass", "a robot learning to paint", "volcanoes",
    "a chess tournament", "medieval bread", "the deep ocean", "a lost umbrella",
    "quantum computing", "a desert caravan", "the first snowfall", "a jazz trumpeter",
    "ancient libraries", "a broken clock", "migrating birds", "a mountain railway",
    "a small bakery", "coral reefs", "an old violin", "the northern lights",
    "a city at night", "paper airplanes", "a forgotten island", "honeybees",
    "a space station", "rainforest frogs", "a street market", "the printing press",
    "a haunted library", "tidal pools", "a marathon runner", "glaciers",
]
_FILLER = (" Write a long, detailed story about it, with many characters, places and events,"
           " and describe everything carefully from the beginning to the very end.")


def load_tokenizer(gguf_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                         gguf_file=os.path.basename(gguf_path))


def make_prompts(tokenizer, count: int, offset: int = 0, length: int = PROMPT_LEN) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` token ids, each different from its first
    tokens on (topic and number lead), numbered from ``offset``."""
    prompts = []
    for k in range(offset, offset + count):
        text = f"{_TOPICS[k % len(_TOPICS)].capitalize()} (story {k}):" + _FILLER
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        while len(ids) < length:
            ids = ids + tokenizer(_FILLER, add_special_tokens=False)["input_ids"]
        prompts.append([int(t) for t in ids[:length]])
    return prompts
