"""The connector talks to the KV manager through its facade only (KVCacheManager's public
methods): no reads of the pool, the coordinator, the managers or anyone's private state."""

from __future__ import annotations

import ast
from pathlib import Path

import loomserve.kv.connector

INTERNALS = {"pool", "coordinator", "managers", "cached", "free_queue", "blocks_for_hit_at"}


def test_connector_uses_the_kv_facade_only():
    found = []
    for path in sorted(Path(loomserve.kv.connector.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            inner = node.value
            on_kv = isinstance(inner, ast.Attribute) and inner.attr == "kv" or \
                isinstance(inner, ast.Name) and inner.id == "kv"
            if node.attr in INTERNALS or on_kv and node.attr.startswith("_"):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not found, "the connector reaches past the KV facade:\n" + "\n".join(found)
