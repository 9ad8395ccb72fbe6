"""--speculative-config: which drafter proposes tokens and how many the engine verifies a step.

vLLM's option shape and key names: a JSON object with "method" ("ngram", "suffix", or "mtp":
the checkpoint's own multi-token-prediction modules, DeepSeek-V3 family),
"num_speculative_tokens" (k, the most drafts per request per step), "prompt_lookup_min" /
"prompt_lookup_max" (ngram: the n-gram lengths tried, longest first) and
"disable_by_batch_size" (no drafts while more requests are running). loomserve's own keys
tune the per-step budget (loomserve.engine.spec.budget): "max_draft_tokens_per_step" (drafts
in one step, all requests together), "min_accepted_per_draft" (the expected accepted tokens
per draft row, from the request's measured acceptance, below which its drafts stop, re-probed
now and then) and "always_draft" (true:
draft up to k whatever acceptance and step time say; the two caps still hold). Unknown keys are
errors, so a typo never silently turns speculation off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

METHODS = ("ngram", "suffix", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    max_draft_tokens_per_step: int = 64
    min_accepted_per_draft: float = 0.15
    always_draft: bool = False  # skip the yield and step-time rules (tests, measurements)
    extra: dict = field(default_factory=dict)  # method-specific keys the drafter reads

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {list(METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError("--speculative-config: num_speculative_tokens must be an integer "
                             f">= 1, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {lo!r} and {hi!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("--speculative-config: disable_by_batch_size must be >= 1")
        if self.max_draft_tokens_per_step < 1:
            raise ValueError("--speculative-config: max_draft_tokens_per_step must be >= 1")
        if not 0.0 <= self.min_accepted_per_draft <= 1.0:
            raise ValueError("--speculative-config: min_accepted_per_draft must be in [0, 1]")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | str | dict | None") -> "SpeculativeConfig | None":
        """A JSON string or a dict (the CLI's and LLM(...)'s forms) -> the config; None: off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON ({e.msg} at column "
                                 f"{e.colno})") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        value = dict(value)
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"--speculative-config needs {key!r}")
        known = {f.name for f in fields(cls)} - {"extra"}
        extra = value.pop("extra", {})
        unknown = sorted(k for k in value if k not in known)
        if unknown and value["method"] in ("ngram", "mtp"):
            raise ValueError(f"--speculative-config: unknown key(s) {unknown} for method "
                             f"{value['method']} (known: {sorted(known)})")
        extra = {**extra, **{k: value.pop(k) for k in unknown}}  # other drafters' own keys
        return cls(**value, extra=extra)


@dataclass
class SpeculativeOptions:
    """The EngineConfig part: one flat option, parsed at construction."""

    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
