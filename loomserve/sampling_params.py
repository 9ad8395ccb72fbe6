"""Sampling parameters, in the shape users know from vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs


@dataclass
class CallFormat:
    """How one tool call is written in a model family's format: `begin`, then a JSON value
    following `schema` (JSON Schema text), then `end`. E.g. Hermes:
    begin='<tool_call>\n{"name": "get_weather", "arguments": ', schema=<params>, end='}\n</tool_call>'."""

    begin: str
    schema: str
    end: str


@dataclass
class ToolCallGrammar:
    """Tool calls the output must contain. required=True (tool_choice required / named): the
    output is one or more calls (each one of `calls`), joined by `separator`, and nothing else.
    required=False (auto with strict tools): free text, but once the text reaches a `trigger`,
    what follows must complete one of `calls` whose begin starts with that trigger."""

    calls: list[CallFormat]
    required: bool = True
    separator: str = "\n"
    triggers: list[str] = field(default_factory=list)
    parallel: bool = True  # more than one call allowed


@dataclass
class StructuredOutputs:
    """A constraint on the generated text, enforced by grammar-constrained decoding in the
    engine's sampler. Exactly one field is set."""

    json_schema: str | None = None  # JSON Schema text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    tool_calls: ToolCallGrammar | None = None


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 disable those filters.
    A seed makes a request's sampling reproducible regardless of what it is batched with.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Features the API layers pass through; the sampler honours each.
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob + k top ones
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # stop tokens are masked until this many tokens are generated
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self._validate_features()

    def _validate_features(self) -> None:
        # OpenAI's ranges: top_logprobs <= 20, penalties in [-2, 2], logit_bias in [-100, 100].
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for tok, bias in (self.logit_bias or {}).items():
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({self.max_tokens})")

    @property
    def uses_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
