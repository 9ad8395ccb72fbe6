"""Generated documents match their generators: a stale page fails here, not in a reader's hands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_reference_current():
    """docs/usage/cli.md is what docs/gen_cli.py writes from today's argparse definitions."""
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_cli.py"), "--check"],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr or proc.stdout


def test_benchmarks_page_current():
    """docs/benchmarks.md is what `python -m benchmarks.report` writes from benchmarks/results/."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.report", "--check"], check=False,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr or proc.stdout


def test_benchmark_ratio_refuses_other_runs_and_hosts():
    """A ratio is taken only within one run on one host, for one statistic."""
    sys.path.insert(0, str(ROOT))
    import pytest

    from benchmarks.report import Measure, RatioRefused, ratio

    a = Measure("loomserve", "median tok/s", 200.0, "Intel Xeon, AVX-512 + AMX", "run 1")
    assert ratio(a, Measure("llama-server", "median tok/s", 100.0, a.host, "run 1")) == 2.0
    for other in (Measure("llama-server", "median tok/s", 100.0, a.host, "run 2"),
                  Measure("llama-server", "median tok/s", 100.0, "AMD EPYC, AVX2", "run 1"),
                  Measure("llama-server", "p90 tok/s", 100.0, a.host, "run 1")):
        with pytest.raises(RatioRefused):
            ratio(a, other)


def test_benchmarks_report_refuses_an_unparsed_result(tmp_path):
    """A results file no summariser claims stops the report; it is not left out silently."""
    sys.path.insert(0, str(ROOT))
    import pytest

    from benchmarks.report import ReportError, render

    (tmp_path / "membw.json").write_text('{"read_gbs": 20.0, "gbs": {}, "settings": '
                                         '{"gib": 2.0, "threads": 2, "repeats": 7}}')
    assert "20.0 GB/s" in render(tmp_path)
    (tmp_path / "mystery.json").write_text("{}")
    with pytest.raises(ReportError, match="unparsed result .*mystery.json"):
        render(tmp_path)
