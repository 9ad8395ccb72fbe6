"""Offline batch inference, in the style of vLLM's `LLM`."""

from __future__ import annotations

import itertools

from loomserve.config import EngineConfig
from loomserve.engine.core import EngineCore
from loomserve.engine.output import RequestOutput
from loomserve.engine.processor import InputProcessor, RequestState
from loomserve.engine.sched.request import RequestStatus
from loomserve.engine.tokenizer import Tokenizer
from loomserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model=None)` loads the built-in default model; keyword arguments are the flat
    engine options (EngineConfig.from_kwargs). The core runs in this process, stepped by
    generate(); it takes the same messages as a served core."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        # An offline batch queues every prompt at once: no admission limit unless asked.
        kwargs.setdefault("max_waiting_requests", 1 << 62)
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.core = EngineCore(self.config)
        ready = self.core.ready()
        self.tokenizer = Tokenizer.from_folder(ready.model_folder, tuple(ready.eos_token_ids))
        self.inputs = InputProcessor(self.tokenizer, ready.max_model_len, ready.vocab_size)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        requests = [self.inputs.make_core_request(str(next(self._ids)), p, sp)
                    for p, sp in zip(prompts, params)]  # all validated before any is queued
        room = self.core.max_waiting_requests - len(self.core.scheduler.waiting)
        if len(requests) > room:
            raise ValueError(f"{len(requests)} prompts exceed max_waiting_requests "
                             f"({self.core.max_waiting_requests})")
        states: dict[str, RequestState] = {}
        for req in requests:
            states[req.request_id] = RequestState(req.request_id, req.prompt_token_ids,
                                                  req.sampling, self.tokenizer)
            self.core.add(req)
        results: dict[str, RequestOutput] = {}
        while self.core.has_work():
            for out in self.core.step():
                state = states[out.request_id]
                results[out.request_id] = state.process([out])
                if state.stopped_by_string:
                    self.core.abort(out.request_id, RequestStatus.FINISHED_STOPPED)
        return [results[rid] for rid in states]

    def close(self) -> None:
        """Stop the KV tiers' background threads (no-op without tiers)."""
        self.core.close()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.inputs.chat_prompt(conv) for conv in conversations]
        return self.generate(prompts, sampling_params)
