"""MultiprocExecutor: the engine core's process is rank 0 (the driver); ranks 1.. are worker
processes (worker_proc.py), one per rank.

Per step: the driver encodes the step message (step_message.py) and broadcasts it, then every
rank runs the forward pass together (the model's all-reduces and the logit gather), and rank 0
samples; its ModelOutput is the step's. Failure is loud, never a hang: before each step the
driver checks its workers (a dead one raises WorkerDied, which the core loop reports as
CoreDead), and a worker dying mid-step closes its sockets, which fails the driver's collective
at once (a stuck one fails it after LOOMSERVE_COLLECTIVE_TIMEOUT_S). Workers die with the core.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import select
import subprocess
import sys
import time

from loomserve.config import EngineConfig
from loomserve.engine.executor.abstract import Executor
from loomserve.execution.batch import ModelInput, ModelOutput
from loomserve.execution.models.loading.loader import resolve_config
from loomserve.execution.parallel import shared_pool
from loomserve.execution.parallel.context_parallel import preflight as dcp_preflight
from loomserve.execution.parallel.state import (
    destroy_distributed,
    device_offset,
    init_distributed,
    master_store,
    set_layout,
)
from loomserve.execution.parallel.step_message import (
    BlockSyncSender,
    StepMessage,
    broadcast_step,
    encode,
)
from loomserve.execution.parallel.tensor_parallel import check_supported
from loomserve.execution.parallel.worker_proc import WorkerSpec, agree_on_kv_plan
from loomserve.execution.worker import Worker

log = logging.getLogger("loomserve.engine")


START_TIMEOUT_S = float(os.environ.get("LOOMSERVE_WORKER_START_TIMEOUT_S", "1800"))


class WorkerDied(RuntimeError):
    pass


def spawn_workers(config: EngineConfig, ranks: list[int], addr: str, port: int,
                  ready_pipes: bool = True) -> list[subprocess.Popen]:
    """One `python -m ...worker_proc` per rank (subprocess, not multiprocessing: the core
    process is a daemonic multiprocessing child, which may not have multiprocessing children).
    With ready_pipes, each Popen gets `.ready`: the read end of its ready pipe."""
    procs = []
    for rank in ranks:
        r, w = os.pipe() if ready_pipes else (None, None)
        fds = tuple(f for f in (w, config.parallel.shared_kv_fd) if f is not None)
        p = subprocess.Popen([sys.executable, "-m", "loomserve.execution.parallel.worker_proc"],
                             stdin=subprocess.PIPE, env=os.environ.copy(), pass_fds=fds)
        if w is not None:
            os.close(w)
        p.ready = r
        spec = WorkerSpec(config, rank, config.parallel.world_size, addr, port, os.getpid(), w)
        p.stdin.write(pickle.dumps(spec))
        p.stdin.close()
        procs.append(p)
    return procs


def wait_loaded(procs: list[subprocess.Popen], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every worker reported its model loaded; WorkerDied at once when one exits first."""
    waiting = {p.ready: (rank, p) for rank, p in enumerate(procs, start=1)}
    deadline = time.monotonic() + timeout_s
    try:
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerDied(f"workers {sorted(r for r, _ in waiting.values())} did not "
                                 f"load the model within {timeout_s:.0f} s")
            ready, _, _ = select.select(list(waiting), [], [], left)
            for fd in ready:
                rank, p = waiting.pop(fd)
                if not os.read(fd, 1):  # the pipe closed without the byte: the worker exited
                    try:
                        code = p.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = None
                    raise WorkerDied(f"tensor-parallel worker rank {rank} (pid {p.pid}) failed "
                                     f"to start (exit code {code}; its log is above)")
    finally:
        for p in procs:
            if p.ready is not None:
                os.close(p.ready)
                p.ready = None


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel
        if pc.world_size > 1 and config.control.role != "both":
            raise NotImplementedError("prefill/decode roles with --tensor-parallel-size or "
                                      "--decode-/--prefill-context-parallel-size > 1 are not "
                                      "supported yet (they would move rank 0's KV heads, tokens "
                                      "or replica only)")
        if pc.world_size > 1 and config.tier.enabled:  # tiers move every rank's shard at once
            shared_pool.check_supported(config)
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                pc, shared_kv_fd=shared_pool.create()))
            pc = config.parallel
        if pc.tensor_parallel_size > 1 or pc.decode_context_parallel_size > 1:
            # refuse an unsupported model before any process starts
            mc = config.model
            model_cls, cfg = resolve_config(mc.model, mc.resolved_cache_dir,
                                            hf_overrides=mc.hf_overrides)
            if pc.tensor_parallel_size > 1:
                check_supported(model_cls, cfg, pc.tensor_parallel_size, mc.quantization)
            if pc.decode_context_parallel_size > 1:
                dcp_preflight(config, model_cls)
        device = config.model.torch_device
        if device.type == "cuda" and pc.world_size > 1:
            import torch
            need = pc.ranks_per_node * pc.dp_local_size
            if torch.cuda.device_count() < need:
                raise ValueError(f"{need} ranks on this node (all DP cores') need as many GPUs; "
                                 f"found {torch.cuda.device_count()} (NCCL takes one per rank)")
        self.world_size = pc.world_size
        self.shared_kv_fd = pc.shared_kv_fd
        addr, port = pc.tp_rendezvous()
        store = None
        if self.world_size > 1:  # listening before any rank starts (state.master_store)
            store = master_store(addr, port or 0, self.world_size)
            port = store.port
        self.procs = spawn_workers(config, [r for r in pc.node_ranks() if r != 0], addr, port)
        self.tp = None
        try:
            t0 = time.perf_counter()
            if self.world_size > 1:
                set_layout(0, self.world_size, device, pc.decode_context_parallel_size,
                           pc.prefill_context_parallel_size, device_offset(pc),
                           pc.tensor_parallel_size)
            # the model loads while the workers start; the rendezvous comes after
            self.worker = Worker(config)
            self.driver_runner = self.worker.runner
            t1 = time.perf_counter()
            if self.world_size > 1:
                wait_loaded(self.procs)
                self.tp = init_distributed(addr, port, device, store)
                agree_on_kv_plan(self.driver_runner, self.tp)
            log.info("%d ranks at %s:%d: model %.1f s, then rendezvous and KV plan %.1f s",
                     self.world_size, addr, port, t1 - t0, time.perf_counter() - t1)
        except BaseException:
            self._stop_workers(0.0)
            destroy_distributed()
            raise
        self.blocks = BlockSyncSender()
        self.bytes_sent = 0  # step-message bytes so far (benchmarks/executor_overhead.py)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def execute_model(self, model_input: ModelInput) -> ModelOutput:
        self._check_workers()
        payload = encode(self.blocks.message(model_input))
        self.bytes_sent += len(payload)
        try:
            if self.tp is not None:
                broadcast_step(payload, self.tp.step_group)
            return self.worker.execute_model(model_input)
        except RuntimeError:  # a collective failed? name the dead rank when there is one
            if self.procs:
                self._await_dead_worker(1.0)
            raise

    def _await_dead_worker(self, within_s: float) -> None:
        """A peer's closed socket can fail the collective a moment before its exit is
        reaped: give it that moment, so the error names the rank (raises WorkerDied)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            self._check_workers()
            time.sleep(0.01)

    def check_health(self) -> None:
        self._check_workers()

    def _check_workers(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                raise WorkerDied(f"tensor-parallel worker rank {rank} (pid {p.pid}) died "
                                 f"({how})")

    def shutdown(self) -> None:
        if self.tp is not None and all(p.poll() is None for p in self.procs):
            try:
                broadcast_step(encode(StepMessage([], [], shutdown=True)), self.tp.step_group)
            except RuntimeError:
                log.warning("could not tell the workers to stop; killing them")
        self._stop_workers(5.0)
        self.tp = None
        destroy_distributed()
        if self.shared_kv_fd is not None:  # the pool's pages live on while they are mapped
            os.close(self.shared_kv_fd)
            self.shared_kv_fd = None

    def _stop_workers(self, grace_s: float) -> None:
        for p in self.procs:
            if p.ready is not None:
                os.close(p.ready)
                p.ready = None
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_headless(config: EngineConfig) -> int:
    """A node other than node 0: run this node's ranks as workers until they exit."""
    pc = config.parallel
    procs = spawn_workers(config, list(pc.node_ranks()), pc.master_addr, pc.master_port,
                          ready_pipes=False)
    return max(p.wait() for p in procs)
