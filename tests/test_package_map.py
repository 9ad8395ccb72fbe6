"""docs/design/overview.md holds the one package map: every folder of loomserve/ and every
module in it, nothing that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "loomserve"


def mapped() -> dict[str, set[str]]:
    """folder (relative to loomserve/, '' for the root) -> file names the map lists."""
    text = (ROOT / "docs" / "design" / "overview.md").read_text()
    section = text.split("## Package map", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for bullet in re.split(r"\n- ", "\n" + section)[1:]:
        head = re.match(r"`([^`]+)/`", bullet)
        if not head:
            continue
        folder = "" if head.group(1) == "loomserve" else head.group(1)
        out[folder] = set(re.findall(r"`([\w.]+\.(?:py|c|h))`", bullet))
    return out


def present(dunders: bool) -> dict[str, set[str]]:
    """Files per folder; package __init__/__main__ only with `dunders` (the map may name one
    that holds code, and need not name the others)."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*"):
        if path.suffix not in (".py", ".c", ".h") or "__pycache__" in path.parts:
            continue
        if not dunders and path.name in ("__init__.py", "__main__.py"):
            continue
        folder = path.parent.relative_to(PACKAGE).as_posix()
        out.setdefault("" if folder == "." else folder, set()).add(path.name)
    return out


def test_package_map_is_complete_and_current():
    have, every, listed = present(False), present(True), mapped()
    missing = sorted(f"{d}/{n}" for d, names in have.items() for n in names - listed.get(d, set()))
    stale = sorted(f"{d}/{n}" for d, names in listed.items() for n in names - every.get(d, set()))
    assert not missing, f"modules missing from docs/design/overview.md's package map: {missing}"
    assert not stale, f"the package map names files that are gone: {stale}"
