"""The core's side of grammar-constrained decoding: compiled grammars, one matcher per request,
the allowed-token bitmask of each step.

Invariants:
- Grammars compile on one worker thread, cached by spec; a request with a grammar is held in
  the waiting queue (Scheduler._held) until its grammar is ready. The first structured request
  also loads the tokenizer's vocabulary there, from the model folder.
- A request's matcher accepts each sampled token once (Request.append_token) and is dropped
  when the request finishes or is aborted (Scheduler.finish).
- The bitmask is as wide as the model's logits: ids beyond the tokenizer's vocabulary are
  never allowed. Once the grammar is complete only the request's stop tokens are.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

from loomserve.execution.structured.grammar import compile_spec, spec_key

log = logging.getLogger("loomserve.execution")

MAX_CACHED_GRAMMARS = 256


class RequestGrammar:
    """One request's grammar: the compile future, then (on the core thread) its matcher."""

    def __init__(self, future: Future, stop_token_ids: list[int]) -> None:
        self.future = future
        self.stop_token_ids = stop_token_ids
        self._matcher = None

    @property
    def ready(self) -> bool:
        return self._matcher is not None or (self.future.done()
                                             and self.future.exception() is None)

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr
            self._matcher = xgr.GrammarMatcher(self.future.result(),
                                               override_stop_tokens=self.stop_token_ids)
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """False when the grammar rejects the token or has ended (it accepted one of its stop
        tokens: with ignore_eos the request's stop tokens are not the grammar's); either way
        the request ends, and its matcher is never asked for another mask."""
        m = self.matcher
        ok = m.accept_token(token_id)
        if not ok:
            log.warning("grammar rejected sampled token %d; ending the request", token_id)
        return ok and not m.is_terminated()


class StructuredManager:
    def __init__(self, model_folder: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_folder = model_folder
        self.vocab_size = vocab_size  # the model's logits width
        self.eos_token_ids = list(eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="loomserve-grammar")
        self._compiler = None  # built on the worker thread by the first compile
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._batch = None
        self.pending: list = []  # requests whose grammar is still compiling

    def attach(self, req) -> None:
        """Give `req` its RequestGrammar (compiling the spec unless cached)."""
        spec = req.sampling.structured
        key = spec_key(spec)
        fut = self._cache.get(key)
        if fut is None:
            fut = self._cache[key] = self._pool.submit(self._compile, spec)
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        req.grammar = RequestGrammar(fut, sorted(req.stop_token_ids) or self.eos_token_ids)
        self.pending.append(req)  # even when done: poll() reports a cached failure

    def poll(self) -> list[tuple[object, str]]:
        """Requests whose grammar failed to compile, with the error; drops finished ones."""
        failed, still = [], []
        for req in self.pending:
            g = req.grammar
            if g is None or req.status.finished:
                continue
            if not g.future.done():
                still.append(req)
            elif g.future.exception() is not None:
                failed.append((req, str(g.future.exception())))
        self.pending = still
        return failed

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s for a pending compile (the core has nothing else to run)."""
        futures = [r.grammar.future for r in self.pending if r.grammar is not None]
        if futures:
            wait(futures, timeout, return_when="FIRST_COMPLETED")

    def fill_bitmask(self, model_input, requests: dict) -> None:
        """Set model_input.token_bitmask and each constrained seq's bitmask_row. One row per
        seq due a token, in the runner's order (seqs with tokens and sample=True), so the
        sampler applies it to its logits rows as they are; other rows stay all-allowed.
        A seq with drafts has 1 + num_draft rows: row i is the mask after its first i drafts
        (the matcher advanced over them, then rolled back; the core only schedules drafts the
        grammar accepts)."""
        due = [s for s in model_input.seqs if s.token_ids and s.sample]
        rows, matchers, drafted = [], [], []
        row = 0
        for seq in due:
            req = requests.get(seq.request_id)
            if req is not None and req.grammar is not None:
                seq.bitmask_row = row
                if seq.num_draft:
                    drafted.append((row, seq, req.grammar.matcher))
                else:
                    rows.append(row)
                    matchers.append(req.grammar.matcher)
            row += 1 + seq.num_draft
        if not rows and not drafted:
            return
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(row, self.vocab_size)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        elif matchers:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        for first, seq, m in drafted:
            m.fill_next_token_bitmask(bitmask, first)
            drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft:]
            for i, t in enumerate(drafts):
                if not m.accept_token(t):
                    raise RuntimeError(f"request {seq.request_id}: a draft its grammar rejects "
                                       "was scheduled")
                m.fill_next_token_bitmask(bitmask, first + i + 1)
            m.rollback(len(drafts))
        model_input.token_bitmask = bitmask

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- worker thread -----------------------------------------------------------------------
    def _compile(self, spec):
        if self._compiler is None:
            self._compiler = self._make_compiler()
        return compile_spec(self._compiler, spec)

    def _make_compiler(self):
        import xgrammar as xgr

        from loomserve.hf_tokenizer import load_hf_tokenizer

        hf = load_hf_tokenizer(self.model_folder)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.eos_token_ids or None)
        log.info("grammar compiler ready (vocabulary of %d tokens)", self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=2)
