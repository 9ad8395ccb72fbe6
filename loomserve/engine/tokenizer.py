"""Tokenizer: a fast HF tokenizer plus the model's chat template and its set of stop tokens."""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loomserve.hf_tokenizer import load_hf_tokenizer

# End-of-turn markers of common chat formats. A chat model ends its turn with one of these, not
# with the tokenizer's eos (SmolLM2 and Qwen use <|im_end|>, Llama 3 <|eot_id|>), so any of them
# that the chat template writes is also a stop token.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, chat_template: str | None = None,
                 eos_token_ids: frozenset[int] | set[int] | tuple[int, ...] = ()) -> None:
        self.hf = hf_tokenizer
        self.chat_template = chat_template
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        vocab = hf_tokenizer.get_vocab()
        for tok in _TURN_END_TOKENS:
            if chat_template and tok in chat_template and tok in vocab:
                eos.add(vocab[tok])
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self._decode = _direct_decode(hf_tokenizer) or hf_tokenizer.decode

    @staticmethod
    def preload() -> None:
        """Import what from_folder needs (transformers' tokenizer classes take seconds to
        import; the package itself imports them lazily, so name them)."""
        from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401

    @classmethod
    def from_folder(cls, folder: str, eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        hf = load_hf_tokenizer(folder)
        return cls(hf, _read_chat_template(folder) or getattr(hf, "chat_template", None), eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API instead")
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.hf.bos_token or "", eos_token=self.hf.eos_token or "", **kwargs)

    @cached_property
    def _template(self) -> jinja2.Template:
        return compile_chat_template(self.chat_template)


def _direct_decode(hf: Any):
    """The Rust tokenizer's own decode where transformers' adds nothing to it (a fast tokenizer
    whose _decode is TokenizersBackend's, no clean-up of spaces), else None. Why: incremental
    detokenization decodes twice per streamed token, and transformers' wrapper (argument
    conversion, batching checks) cost ~25 us of the ~34 us of each call."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(hf, "backend_tokenizer", None)
    if (backend is None or type(hf)._decode is not TokenizersBackend._decode
            or getattr(hf, "clean_up_tokenization_spaces", False)):
        return None
    return backend.decode


class _GenerationTags(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} (HF's assistant-mask tags): render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson: keys in the given order, non-ASCII kept, no HTML escaping (unlike jinja's).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def template_environment() -> ImmutableSandboxedEnvironment:
    """The environment HF chat templates are written for: trimmed blocks, loop controls,
    HF's tojson, raise_exception() (surfaced as ValueError) and strftime_now()."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationTags])

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def compile_chat_template(text: str) -> jinja2.Template:
    return template_environment().from_string(text)


def _read_chat_template(folder: str) -> str | None:
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        tmpl = json.load(f).get("chat_template")
    if isinstance(tmpl, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in tmpl}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl
