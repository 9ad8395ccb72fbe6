"""DEP: data-parallel engine cores of an MoE model stepping in lockstep, experts sharded
across them (`--data-parallel-size N --enable-expert-parallel`).

Each DP rank is its own engine core process (loomserve.engine.dp_client). With expert
parallelism every MoE layer's forward is a collective over the DP ranks' gloo group
(loomserve.execution.layers.moe), so all ranks must run the same number of forwards:

- every loop turn each rank all-reduces (max) "I have work"; when no rank has any, all idle
  together (a short sleep, the core's idle housekeeping now and then);
- otherwise every rank steps: a rank with work runs its real step; a rank without work, or
  whose step ran no model forward (nothing schedulable, e.g. between prefill-interval steps),
  runs a dummy step: each MoE layer's collectives with zero tokens (not a whole 1-token model
  forward: only the MoE layers communicate, and zero tokens touch no KV);
- the step number is global (the count of lockstep steps, the same on every rank) and is set
  into the scheduler before each step, so --prefill-schedule-interval admits prefills on the
  same steps on every rank.

Async scheduling (engine/step_overlap.py): forwards run on each rank's execution thread, in
the order they were started, so a turn's dummy step is queued there too (after the step in
flight), and every rank's execution thread runs one forward or dummy a turn, in turn order;
the "I have work" all-reduce runs on the core thread over a group of its own (two threads must
never share a gloo group: their collectives could pair across ranks out of order).

The group meets at ParallelConfig.dp_rendezvous() (the front end's port, or master_addr:master_port over nodes). Dense models
need no lockstep: LockstepCore is only used when the model has MoE layers.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch

from loomserve.execution.layers.expert_parallel import ExpertParallel

log = logging.getLogger("loomserve.execution")

IDLE_SLEEP_S = 0.005  # an all-idle turn's pause (every rank polls together)
IDLE_HOUSEKEEPING_S = 0.25
GROUP_TIMEOUT_S = 60.0


def maybe_lockstep(core, config):
    """The core to run: `core` itself, or a LockstepCore around it under DEP."""
    pc = config.parallel
    if not (getattr(pc, "enable_expert_parallel", False) and pc.data_parallel_size > 1):
        return core
    moes = [m for m in core.runner.model.modules() if isinstance(m, ExpertParallel)]
    if not moes:
        log.info("--enable-expert-parallel: the model has no MoE layers; DP ranks run freely")
        return core
    import torch.distributed as dist
    if not dist.is_initialized():
        addr, port = pc.dp_rendezvous()
        timeout = timedelta(seconds=GROUP_TIMEOUT_S)
        if pc.nnodes > 1:  # DP rank 0 hosts the rendezvous at master_addr:master_port
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                                    rank=pc.data_parallel_rank,
                                    world_size=pc.data_parallel_size, timeout=timeout)
        else:  # the front end's store, listening since before the cores started (dp_client)
            store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
            dist.init_process_group("gloo", store=dist.PrefixStore("loomserve-dp", store),
                                    rank=pc.data_parallel_rank,
                                    world_size=pc.data_parallel_size, timeout=timeout)
    group = dist.group.WORLD
    for m in moes:
        m.enable_ep(group, pc.data_parallel_rank, pc.data_parallel_size)
    log.info("DP rank %d/%d: expert parallel over %d MoE layers, %d experts each",
             pc.data_parallel_rank, pc.data_parallel_size, len(moes),
             moes[0].local_experts)
    # async scheduling: the turn's all-reduce on the core thread, beside the execution
    # thread's all-to-alls on WORLD (every rank creates it: same config, same order)
    flags = dist.new_group(backend="gloo") if core.overlap is not None else group
    return LockstepCore(core, moes, group, flags)


class LockstepCore:
    """An EngineCore whose steps are in lockstep with the other DP ranks' (see the module
    docstring). has_work() is always True so the core loop turns without blocking; step()
    decides, with the other ranks, whether this turn is a step or an idle pause."""

    # A Shutdown reaches the ranks at slightly different times: one that leaves first makes a
    # peer's next all-reduce fail. The core loop then waits this long for its own Shutdown
    # before calling the failure a real one (core_loop.CoreLoop.run).
    peer_grace_s = 2.0

    def __init__(self, core, moes, group, flags=None) -> None:
        self.core, self.moes, self.group = core, moes, group
        self.flags = flags if flags is not None else group  # the turn's all-reduce's group
        self.global_step = 0
        self.dummy_steps = 0
        self._idle_at = 0.0
        emb = next(core.runner.model.parameters())
        self._dtype, self._device = emb.dtype, emb.device

    def __getattr__(self, name):  # add, abort, end_session, stats, ready, close ...
        return getattr(self.core, name)

    def has_work(self) -> bool:
        return True

    def close(self) -> None:
        """Close the core, then leave the DP group (else the process's exit waits seconds
        on the group's teardown)."""
        import torch.distributed as dist
        try:
            self.core.close()
        finally:
            log.info("DP lockstep: %d steps, %d of them dummy on this rank (%.1f%%); expert "
                     "all-to-all: %d (token, expert) pairs routed, %d bytes sent to other ranks "
                     "over %d MoE layers", self.global_step, self.dummy_steps,
                     100.0 * self.dummy_steps / max(1, self.global_step),
                     sum(m.ep_pairs for m in self.moes), sum(m.ep_bytes for m in self.moes),
                     len(self.moes))
            dist.destroy_process_group()

    def idle(self) -> None:  # never called: has_work() is always True
        self.core.idle()

    def step(self):
        import torch.distributed as dist
        flag = torch.tensor([1 if self.core.has_work() else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flags)
        if not flag.item():
            now = time.monotonic()
            if now - self._idle_at >= IDLE_HOUSEKEEPING_S:
                self.core.idle()
                self._idle_at = now
            time.sleep(IDLE_SLEEP_S)
            return []
        self.core.scheduler.step_number = self.global_step
        self.global_step += 1
        before = self._forwards()
        outputs = self.core.step() if self.core.has_work() else []
        if self._forwards() == before:  # this rank started no forward: keep the others company
            self.dummy_steps += 1
            ov = self.core.overlap
            if ov is not None:  # async scheduling: after the step in flight, on its thread
                ov.run_after(self._dummy)
            else:
                self._dummy()
        return outputs

    def _forwards(self) -> int:
        """Forwards started so far (async scheduling: on the execution thread)."""
        ov = self.core.overlap
        return ov.num_forwards if ov is not None else self.moes[0].ep_calls

    def _dummy(self) -> None:
        for m in self.moes:
            m.ep_dummy(self._dtype, self._device)
