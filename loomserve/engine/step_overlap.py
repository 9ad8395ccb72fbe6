"""Async scheduling (vLLM's --async-scheduling): step N executes on one execution thread
while the core thread schedules step N+1, and applies step N's tokens once N+1 is running.

The scheduler counts a scheduled step as computed at once and gives every request it samples
for a placeholder token (engine/sched/scheduler.py); the next step's input carries
PLACEHOLDER_TOKEN for it. Steps run on the execution thread one at a time, in schedule order,
and each fills its placeholders from the step before's sampled ids (a placeholder always names
the step just before: a request whose token is still unknown when the next step is scheduled
is scheduled again only after it is known). So preparing step N+1 never waits for step N, and
every KV read or write happens in schedule order, as without async scheduling: blocks freed
while a step is in flight (a finish, an abort, a preemption) are reused only by later steps.

Invariants: at most one step in flight; the core thread never touches the runner while one is
(the runner's state belongs to the execution thread); a request's block-id lists only grow
while it lives (KV managers), so the step in flight reads them safely while the core appends
(a sliding window nulls the entries leaving it in place, so under async scheduling only those
the step in flight does not attend to either: kv/managers/sliding_window.py).

More than one rank (TP, decode/prefill context parallel, with or without DP): execute_model
and with it every collective and the step message run on the execution thread only, so the
ranks see the steps in schedule order; the message takes a block list's length once and
slices to it (parallel/step_message.py), the core thread appending meanwhile.
Hybrid models: the block boundary a decode step's row crosses ends at its input token, still a
placeholder when the step is scheduled; its state checkpoint is planned anyway and hashed once
the token is known (kv/managers/linear_state.py), so the checkpoints are the synchronous
engine's. A request that stopped runs one extra row in the step in flight: its input is the
stop token, already among the request's tokens, so the state and KV that row leaves are exact
for them; where it ends a block, that block stays hittable, one more than without async
scheduling (docs/design/scheduler.md, "Async scheduling").

P/D legs: a prefill leg is staged in the update of the step that ran its last chunk (done by
then; a request at its max_tokens is not scheduled again), from rows freed just before and given
to no step yet. A decode leg's import (a tier load, a tail copy) writes rows claimed at schedule
time, which may be rows freed while the step in flight still writes them (a finish's extra row,
an abort, a preemption). Its tier load waits for that step (KV tiers, below); the tail copy runs
on the core thread at admission, so while a decode leg's tail is read or ready and requests wait,
a step only finishes the one in flight and the next schedules with none (EngineCore._drain_first).

KV tiers: a block is hashed when allocated for the step about to start, and the update of step
N hashes (a finish writes down) blocks whose last row step N+1 writes; rows a tier load claims
at schedule time may be rows the step in flight still writes. So the tier connector (paced by
EngineCore with in_flight) copies a page down only once every step that may write it has run,
holding its block meanwhile, and starts a load claimed while a step ran only once the swap has
returned that step (kv/connector/stores.py, loads.py).

Speculative decoding: a step with drafts runs alone. Drafts follow a request's latest token
and a verified request's count is known only at update, so the core finishes the step in
flight before scheduling one that may draft, and finishes a step with drafts before scheduling
the next (EngineCore._drain_first; which requests may draft: engine/spec/verify.py). Steps
without drafts overlap as usual; the update rolls a verified request back as the synchronous one.

DEP (expert parallelism over DP ranks): a lockstep turn's dummy step runs on the execution
thread after the step in flight (run_after), so every rank's MoE collectives keep turn order
(execution/parallel/dp_lockstep.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from loomserve.engine.sched.request import PLACEHOLDER_TOKEN
from loomserve.engine.sched.scheduler import SchedulerOutput
from loomserve.execution.batch import ModelInput, ModelOutput


def leave_a_core(device) -> int | None:
    """On a CPU, the model's threads leave one core to the core thread (unless
    LOOMSERVE_NUM_THREADS fixes them): the overlap runs host work beside the model, and an
    OpenMP team on every core stalls at each barrier while a member's core runs that work
    (measured on 2 cores: 0.46x-0.57x the synchronous engine's tok/s). Returns the threads
    it had when changed (torch's count is per process: StepOverlap.close restores it)."""
    import os

    import torch
    if device.type != "cpu" or os.environ.get("LOOMSERVE_NUM_THREADS"):
        return None
    n = torch.get_num_threads()
    if n <= 1:
        return None
    torch.set_num_threads(n - 1)
    return n


def _cuda_device() -> int | None:
    """The calling thread's CUDA device, once CUDA is in use (a DP core's rank 0 is not on
    device 0: set_device in core_proc / parallel.state is per thread)."""
    import torch
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _use_device(device: int | None) -> None:
    """The execution thread's initializer: launch on the core thread's CUDA device."""
    if device is not None:
        import torch
        torch.cuda.set_device(device)


class StepOverlap:
    """One step in flight on the execution thread; `swap` hands it the next one."""

    def __init__(self, execute, restore_threads: int | None = None) -> None:
        self._execute = execute  # the executor's execute_model
        self._restore_threads = restore_threads  # torch's threads before leave_a_core
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="loomserve-execute",
                                          initializer=_use_device, initargs=(_cuda_device(),))
        self._pending: tuple[SchedulerOutput, Future] | None = None
        self._last_sampled: dict[str, int] = {}  # the execution thread's only
        # Seconds the core thread waited for a step, and the execution thread spent in steps
        # (benchmarks/async_scheduling.py: the host work the overlap hides).
        self.wait_s = 0.0
        self.execute_s = 0.0
        self.num_steps = 0  # steps started
        self.num_overlapped = 0  # of them, started while the step before was in flight
        self.num_forwards = 0  # of them, with sequences (a model forward)
        self._side: list[Future] = []  # run_after's, until seen done

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    @property
    def drafts_in_flight(self) -> bool:
        """The step in flight verifies drafts (its requests' counts are not known yet)."""
        return self._pending is not None and bool(self._pending[0].num_drafts)

    def swap(self, sched: SchedulerOutput
             ) -> tuple[SchedulerOutput, ModelOutput, float] | None:
        """Start `sched` (when it has anything for the workers) and return the step in flight
        before it, once done, with its output and execution seconds; None if there was none."""
        inp = sched.model_input
        started = None
        if inp.seqs or inp.finished_request_ids:
            if self.drafts_in_flight:  # its requests' counts are unknown (_drain_first)
                raise RuntimeError("a step was scheduled while drafts were being verified")
            started = (sched, self._thread.submit(self._run, inp))
            self.num_steps += 1
            self.num_overlapped += self._pending is not None
            self.num_forwards += bool(inp.seqs)
        done, self._pending = self._pending, started
        if done is None:
            return None
        t0 = time.perf_counter()
        output, seconds = done[1].result()  # re-raises the step's exception here
        self.wait_s += time.perf_counter() - t0
        self._check_side()
        return done[0], output, seconds

    def run_after(self, fn) -> None:
        """Run fn on the execution thread after the steps started so far (DEP: a dummy step's
        collectives, in the order the peers run theirs); its exception surfaces at a swap."""
        self._side.append(self._thread.submit(fn))

    def _check_side(self) -> None:
        side, self._side = self._side, []
        for f in side:
            if f.done():
                f.result()  # re-raises its exception
            else:
                self._side.append(f)

    def _run(self, inp: ModelInput) -> tuple[ModelOutput, float]:
        """On the execution thread: fill the placeholders, run the step."""
        last = self._last_sampled
        for s in inp.seqs:
            if s.token_ids and s.token_ids[-1 - s.num_draft] == PLACEHOLDER_TOKEN:
                s.token_ids[-1 - s.num_draft] = last[s.request_id]  # a decode's own token
            if s.history and s.history[-1] == PLACEHOLDER_TOKEN:
                s.history[-1] = last[s.request_id]
        t0 = time.perf_counter()
        out = self._execute(inp)
        seconds = time.perf_counter() - t0
        self.execute_s += seconds
        self._last_sampled = out.sampled
        return out, seconds

    def close(self) -> None:
        """Finish the step in flight (its output is dropped) and stop the thread."""
        self._pending = None
        self._thread.shutdown(wait=True)
        if self._restore_threads is not None:
            import torch
            torch.set_num_threads(self._restore_threads)
