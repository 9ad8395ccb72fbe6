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
