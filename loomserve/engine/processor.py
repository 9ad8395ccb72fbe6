"""The engine's front end: prompts in (validated, tokenized), text out (detokenized, stops).

Both run outside the engine core's loop: the core only sees token ids, so its step time does
not grow with detokenization, and a stop string ends a request by aborting it in the core.
"""

from __future__ import annotations

from loomserve.engine.messages import CoreOutput, EngineCoreRequest
from loomserve.engine.output import RequestOutput
from loomserve.engine.sched.request import Request
from loomserve.execution.structured import validate_structured
from loomserve.kv.transfer.params import validate as validate_transfer_params
from loomserve.sampling_params import SamplingParams

# Prompt tokens kept as left context so the first output token decodes with its leading space
# (SentencePiece-style tokenizers drop it when a token is decoded alone).
_DETOK_CONTEXT = 5


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise ValueError("messages must not be empty")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     **session) -> Request:
        """An in-process core's Request (for `LLM` and tests that step a core by hand)."""
        return Request.from_message(self.make_core_request(request_id, prompt, params, **session))

    def _validate_features(self, params: SamplingParams) -> None:
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size "
                             f"{self.vocab_size}, got {bad[0]}")
        if params.structured is not None:
            validate_structured(params.structured)

    def make_core_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          **session) -> EngineCoreRequest:
        """Validate everything the engine would otherwise trip over; ValueError says why."""
        params.validate()
        self._validate_features(params)
        validate_transfer_params(session.get("kv_transfer_params"))
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
               for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but the model's context length is "
                             f"{self.max_model_len} and at least one token must be generated")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(f"max_tokens={max_tokens} is too large: the prompt has {len(ids)} tokens"
                             f" and the context length is {self.max_model_len}")
        return EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling=params,
                                 max_tokens=max_tokens,
                                 eos_token_ids=sorted(self.tokenizer.eos_token_ids), **session)


class RequestState:
    """Incremental detokenization and stop-string matching for one request."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.text = ""
        self._ids = list(prompt_token_ids[-_DETOK_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._sent_text = 0  # chars of text already reported
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self.finished = False
        self.finish_reason: str | None = None
        self.stopped_by_string = False  # the core must be told to abort this request
        self.stop_reason: str | None = None  # the stop string that matched
        self.queued_s: float | None = None  # the core's wait before admission, once known
        # Tokens whose text never shows when they end the request (tool parsers keep special
        # tokens, but the closing <|im_end|> is not content).
        # (with ignore_eos an EOS can still end it: the one a completed grammar allows)
        self._stop_ids = set(params.stop_token_ids) | set(getattr(tokenizer, "eos_token_ids", ()))

    def process(self, outs: list[CoreOutput]) -> RequestOutput:
        """Fold one or more core outputs into a RequestOutput with the deltas since the last."""
        new_ids: list[int] = []
        new_lps: list | None = [] if self.params.logprobs is not None else None
        cached = tier_cached = 0
        transfer = None
        miss = None
        for out in outs:
            miss = getattr(out, "miss", None) or miss
            cached = out.num_cached_tokens
            tier_cached = getattr(out, "num_tier_cached_tokens", 0)
            if getattr(out, "queued_s", -1.0) >= 0:
                self.queued_s = out.queued_s
            if self.finished:
                break
            lps = getattr(out, "logprobs", None)
            last = len(out.new_token_ids) - 1
            for k, tok in enumerate(out.new_token_ids):
                new_ids.append(tok)
                self.token_ids.append(tok)
                if new_lps is not None and lps is not None:
                    lp, ids, vals = lps[k]
                    new_lps.append((lp, list(zip(ids, vals))))
                    self.logprobs.append(new_lps[-1])
                if (k == last and out.finished and out.finish_reason == "stop"
                        and tok in self._stop_ids):
                    break  # the finishing stop token: in token_ids, not in the text
                delta = self._detokenize(tok)
                self.text += delta
                if self._check_stop_strings(len(delta)):
                    break
            if out.finished and not self.finished:
                self.finished, self.finish_reason = True, out.finish_reason
                transfer = getattr(out, "kv_transfer_params", None)
        # Text that might be the start of a stop string is held back until it can't be.
        end = len(self.text) if self.finished else max(self._sent_text, len(self.text) - self._hold)
        new_text = self.text[self._sent_text:end]
        self._sent_text = end
        return RequestOutput(self.request_id, self.prompt_token_ids, self.token_ids, self.text,
                             new_ids, new_text, self.finished, self.finish_reason, max(cached, 0),
                             tier_cached, new_lps, self.logprobs, self.stop_reason, transfer,
                             self.queued_s, miss_causes=miss and miss.get("causes"),
                             miss_detail=miss and miss.get("detail"))

    def _detokenize(self, token: int) -> str:
        self._ids.append(token)
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix):]
        return ""  # an incomplete UTF-8 sequence: wait for the next token

    def _check_stop_strings(self, num_new_chars: int) -> bool:
        if not self.params.stop or not num_new_chars:
            return False
        if len(self.token_ids) < self.params.min_tokens:
            return False  # as vLLM: stop strings, like stop tokens, wait for min_tokens
        window = len(self.text) - num_new_chars - self._hold  # only the tail can hold a new match
        hits = [(i, -len(s), s) for s in self.params.stop
                if (i := self.text.find(s, max(0, window))) >= 0]
        if not hits:
            return False
        at, _, self.stop_reason = min(hits)  # the first match; the longest of those at one place
        self.text = self.text[:at]
        self._sent_text = min(self._sent_text, len(self.text))
        self.finished, self.finish_reason, self.stopped_by_string = True, "stop", True
        return True
