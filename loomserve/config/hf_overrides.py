"""--hf-overrides: a JSON object merged into a model's HF config dict before it is parsed.

As vLLM's flag of the same name: the way to run a checkpoint with a config it does not ship,
most often RoPE scaling past the trained context
(`{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings":
8192}}`). Applied wherever the config is read (the worker's load, the parallel preflight), on
the dict as config.json (or a GGUF's conversion) holds it; the files themselves are never
changed, so the conversion cache stays the checkpoint's.
"""

from __future__ import annotations

import copy
import json
from typing import Any


def parse_hf_overrides(value: str | dict | None) -> dict[str, Any] | None:
    """A JSON object (text or an already parsed dict) -> the overrides; None or {} -> None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--hf-overrides is not valid JSON ({e.msg} at column "
                             f"{e.colno}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--hf-overrides must be a JSON object ({{\"key\": value, ...}}), "
                         f"not {type(value).__name__}: {value!r}")
    return value or None


def merge_hf_overrides(config: dict[str, Any], overrides: dict[str, Any] | None
                       ) -> dict[str, Any]:
    """A new dict: `config` with `overrides` merged in. A dict value merges into a dict already
    there, key by key and recursively (so `{"rope_parameters": {"factor": 4}}` keeps the
    checkpoint's rope_theta); any other value replaces. `config` is left untouched."""
    out = copy.deepcopy(config)
    _merge(out, overrides or {})
    return out


def _merge(target: dict[str, Any], updates: dict[str, Any]) -> None:
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
