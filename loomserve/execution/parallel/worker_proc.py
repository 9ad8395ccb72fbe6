"""A worker process: one rank > 0, owning its ModelRunner (its weight and KV-head slices).

Started by the driver (MultiprocExecutor, in the engine core's process) or by a headless node
as `python -m loomserve.execution.parallel.worker_proc`, its WorkerSpec pickled on stdin (once,
at start: the per-step traffic is the step message). It joins the rendezvous, builds its
runner, agrees with the others on the KV plan, then runs the forward pass of every step the
driver broadcasts until a shutdown message. It never samples (rank 0 does). A byte on its
ready pipe tells the driver its model loaded, so a worker that fails at start is seen at once
(the pipe's end) instead of at the rendezvous timeout. LOOMSERVE_WORKER_FAIL_AT_START=RANK
makes that rank fail at start (a debug hook for tests). It dies with its
parent (PR_SET_PDEATHSIG) and exits 1 on any error, e.g. when the driver's sockets close.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass

import torch

from loomserve.config import EngineConfig
from loomserve.config.log_lines import configure_child
from loomserve.execution.model_runner import ModelRunner
from loomserve.execution.parallel.state import (
    destroy_distributed,
    device_offset,
    init_distributed,
    set_layout,
)
from loomserve.execution.parallel.step_message import BlockSyncReceiver, broadcast_step
from loomserve.execution.process import die_with_parent

log = logging.getLogger("loomserve.execution.worker")


@dataclass
class WorkerSpec:
    config: EngineConfig
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    parent_pid: int
    ready_fd: int | None = None  # a pipe to the driver: one byte once the model is loaded


def agree_on_kv_plan(runner, tp) -> None:
    """Every rank must plan the same number of blocks (the driver's ids index every pool)."""
    mine = torch.tensor([runner.kv_cache_config.num_blocks], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(tp.size)]
    torch.distributed.all_gather(every, mine, group=tp.step_group)
    counts = [int(t.item()) for t in every]
    if len(set(counts)) != 1:
        raise RuntimeError(f"ranks planned different KV block counts {counts}: give every rank "
                           "the same --kv-cache-memory")


def run_worker(spec: WorkerSpec) -> int:

    config = spec.config
    device = config.model.torch_device
    set_layout(spec.rank, spec.world_size, device,
               config.parallel.decode_context_parallel_size,
               config.parallel.prefill_context_parallel_size, device_offset(config.parallel),
               config.parallel.tensor_parallel_size)
    try:
        if os.environ.get("LOOMSERVE_WORKER_FAIL_AT_START") == str(spec.rank):  # debug hook
            raise RuntimeError(f"LOOMSERVE_WORKER_FAIL_AT_START={spec.rank}")
        runner = ModelRunner(config)  # before the rendezvous: loads while the others start
        if spec.ready_fd is not None:
            os.write(spec.ready_fd, b"R")
            os.close(spec.ready_fd)
        tp = init_distributed(spec.master_addr, spec.master_port, device)
        agree_on_kv_plan(runner, tp)
        blocks = BlockSyncReceiver()
        while True:
            msg = broadcast_step(None, tp.step_group)
            if msg.shutdown:
                return 0
            inp = blocks.model_input(msg)
            runner.compute_logits(inp)
            if runner.mtp is not None:  # its part of the MTP drafts, fed rank 0's sampled ids
                runner.mtp.propose(runner, runner.step_seqs, None, inp.finished_request_ids)
    finally:
        destroy_distributed()


def main() -> None:
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    die_with_parent(spec.parent_pid)
    configure_child(os.environ.get("LOOMSERVE_LOG_LEVEL", "INFO"), f"rank {spec.rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    try:
        code = run_worker(spec)
    except BaseException:  # noqa: BLE001 - logged, then a nonzero exit the driver notices
        log.error("worker rank %d failed\n%s", spec.rank, traceback.format_exc())
        code = 1
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: no lingering gloo threads


if __name__ == "__main__":
    main()
