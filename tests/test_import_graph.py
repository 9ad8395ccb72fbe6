"""The package's import graph: planes in one order, no circles.

Every import of a loomserve module counts, wherever it stands (module level, inside a function,
under TYPE_CHECKING): an import placed inside a function is there for start-up cost or an
optional dependency, never to dodge a circle, so hoisting any of them must stay legal.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "loomserve"

# cli -> {bench, control, api} -> engine -> execution -> kv -> config. The three front planes
# are ordered too (bench may replay through the router's pieces, the router renders prompts
# with the API's chat layer), so every arrow between planes runs down this list.
FLOORS = [
    ("loomserve", "loomserve.__main__", "loomserve.cli"),
    ("loomserve.bench",),
    ("loomserve.control",),
    ("loomserve.api",),
    ("loomserve.engine",),
    ("loomserve.execution",),
    ("loomserve.kv",),
    ("loomserve.config", "loomserve.sampling_params", "loomserve.hf_tokenizer"),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def floor(mod: str) -> int:
    best, depth = None, -1
    for i, names in enumerate(FLOORS):
        for name in names:
            exact = mod == name
            if (exact or mod.startswith(name + ".")) and (name.count(".") > depth or exact):
                if name == "loomserve" and not exact:
                    continue
                best, depth = i, name.count(".")
    if best is None:
        raise AssertionError(f"{mod} is on no floor: add it to FLOORS")
    return best


def edges(mods: dict[str, Path]) -> set[tuple[str, str, int]]:
    """(importer, imported, line) for every import of a loomserve module."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out = set()
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loomserve"):
                targets = [resolve(f"{node.module}.{a.name}") for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names if a.name.startswith("loomserve")]
            else:
                continue
            out.update((mod, t, node.lineno) for t in targets if t and t != mod)
    return out


@pytest.fixture(scope="module")
def graph():
    mods = modules()
    return mods, edges(mods)


def test_every_module_has_a_floor(graph):
    mods, _ = graph
    for mod in mods:
        floor(mod)


def test_no_import_runs_up_the_floors(graph):
    _, es = graph
    up = sorted(f"{a}:{line} -> {b}" for a, b, line in es if floor(a) > floor(b))
    assert up == [], "imports running back up the plane order:\n" + "\n".join(up)


def test_no_circles(graph):
    mods, es = graph
    succ: dict[str, set[str]] = {m: set() for m in mods}
    for a, b, _ in es:
        succ[a].add(b)
    # Tarjan's strongly connected components, iteratively (the graph is a few hundred nodes).
    index, low, on, stack, sccs, counter = {}, {}, set(), [], [], [0]

    def strong(v: str) -> None:
        work = [(v, iter(sorted(succ[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(succ[w]))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        sccs.append(sorted(comp))

    for v in sorted(mods):
        if v not in index:
            strong(v)
    assert sccs == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in sccs)
