"""n samples of one prompt (OpenAI's `n`) as n engine requests read as one stream.

Sample i is request f"{rid}-{i}" (just `rid` when n == 1); samples i > 0 are siblings of
sample 0 (their prefill waits for its prompt KV and reuses it), and with a seed, sample i
samples with seed + i so samples differ yet stay reproducible. `Samples` yields a `Batch` of
whatever outputs arrived, each tagged with its sample's index; closing it aborts every sample.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from fastapi import Request

from loomserve.engine.output import RequestOutput
from loomserve.sampling_params import SamplingParams


@dataclass
class Batch:
    parts: list[tuple[int, RequestOutput]]  # (sample index, its latest output)
    finished: bool  # every sample has finished
    new_token_ids: tuple = ()  # per-sample timers count tokens; the Handler's sees none
    finish_reason: str | None = None


class NullTimer:
    def observe(self, out) -> None:
        pass


class Samples:
    def __init__(self, its: list, firsts: list[RequestOutput], timers: list) -> None:
        self.its, self.timers = its, timers
        self.latest: list[RequestOutput] = list(firsts)
        self._pending: dict[int, asyncio.Future] = {}

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.latest)

    def first_batch(self) -> Batch:
        return Batch(list(enumerate(self.latest)), self.finished)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Batch:
        if self.finished:
            raise StopAsyncIteration
        if len(self.its) == 1:  # n == 1: no task and no wait() per token (~60 us of the loop)
            return Batch([self._took(0, await self._next(self.its[0], 0))], self.finished)
        for i, it in enumerate(self.its):
            if not self.latest[i].finished and i not in self._pending:
                self._pending[i] = asyncio.ensure_future(self._next(it, i))
        await asyncio.wait(self._pending.values(), return_when=asyncio.FIRST_COMPLETED)
        parts = []
        for i in sorted(self._pending):
            task = self._pending[i]
            if not task.done():
                continue
            del self._pending[i]
            parts.append(self._took(i, task.result()))
        return Batch(parts, self.finished)

    @staticmethod
    async def _next(it, i: int) -> RequestOutput:
        """Sample i's next output; a sample must finish before its stream ends."""
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"sample {i} ended without finishing") from None

    def _took(self, i: int, out: RequestOutput) -> tuple[int, RequestOutput]:
        """Sample i's new output, timed and recorded, as a batch part."""
        self.timers[i].observe(out)
        self.latest[i] = out
        return i, out

    async def aclose(self) -> None:
        for task in self._pending.values():
            task.cancel()
        self._pending.clear()
        for it in self.its:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    pass


def sample_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


async def start_samples(h, request: Request, prompt, params: SamplingParams, request_id: str,
                        n: int, **kw) -> Samples:
    """Start n samples through h.start (each waits for its first output); if one fails, the
    others are aborted and its error is raised."""
    ids = sample_ids(request_id, n)

    def params_of(i: int) -> SamplingParams:
        return params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)

    results = await asyncio.gather(*(
        h.start(request, prompt, params_of(i), rid, sibling_of=ids[0] if i else None, n=n,
                **kw)
        for i, rid in enumerate(ids)), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r, rid in zip(results, ids):
            if not isinstance(r, BaseException):
                await h._abort(r[0], rid)
        raise errors[0]
    its, firsts, timers = (list(x) for x in zip(*results))
    return Samples(its, firsts, timers)
