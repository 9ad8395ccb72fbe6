"""Session-wide test setup.

Without CUDA, the Triton attention kernels run under Triton's interpreter. The switch must be
on before anything imports triton: triton binds its own @jit helpers (tl.zeros, tl.max, ...)
at import, and an interpreted kernel cannot call a compiled helper. Child processes the tests
start inherit it; they run no Triton code on a CPU.

In CI (the CI variable set, as CI services set it) a test may skip only for want of CUDA. Any
other skip (a missing package such as Mooncake, anthropic or openai-agents, a missing
redis-server, libibverbs or C compiler, a missing fixture) means `make test` did not install
what the suite needs: under CI it is reported as a failure that names the reason.
"""

import os
import re

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs two workers) each worker computes on one thread,
# and so do the engine processes its tests start (they inherit the environment): a second
# OpenMP thread per worker would wait on siblings descheduled by the other worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("LOOMSERVE_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

SKIP_ALLOWED_IN_CI = re.compile(r"\bCUDA\b")


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def _fail_forbidden_skip(report) -> None:
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if not SKIP_ALLOWED_IN_CI.search(reason):
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI, where only tests that need CUDA may skip: {reason}"
                           "\n(`make test` installs the suite's dependencies; see the Makefile)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_forbidden_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # a module-level importorskip skips the whole module here
    _fail_forbidden_skip(outcome.get_result())
