"""Agent-shaped work for speculative decoding: edits that copy a file, sessions that re-read it,
and a control set with nothing to copy.

- edit: a real Python source file from the installed packages (150-250 lines, chosen
  deterministically from site-packages) and a request to rewrite it whole with one rename
  ("changing `a` to `b`"): the answer repeats the prompt, as an agent's edit repeats the file.
  The file comes first so streams on the same file share its KV blocks.
- session: a conversation per session id (X-Session-ID) on a smaller file (80-140 lines); each
  turn re-reads the file (the whole file is resent as the turn's tool result) and asks for
  another rename; the history (earlier turns and answers) is resent too, as agents do.
- control: open-ended questions with nothing in the prompt to copy.

Invariants: the same arguments give the same prompts (sorted file list, no randomness); every
prompt fits the built-in model's 8192-token context with its answer.
"""

from __future__ import annotations

import glob
import os
import re
import sysconfig
from dataclasses import dataclass, field

TOPICS = [
    "a lighthouse keeper", "the history of glass", "a robot learning to paint", "volcanoes",
    "a chess tournament", "medieval bread", "the deep ocean", "a lost umbrella",
    "quantum computing", "a desert caravan", "the first snowfall", "a jazz trumpeter",
    "ancient libraries", "a broken clock", "migrating birds", "a mountain railway",
    "a small bakery", "coral reefs", "an old violin", "the northern lights",
    "a city at night", "paper airplanes", "a forgotten island", "honeybees",
    "a space station", "rainforest frogs", "a street market", "the printing press",
    "a haunted library", "tidal pools", "a marathon runner", "glaciers",
]
QUESTIONS = ["Write a short story about {}.", "Explain to a child what is special about {}.",
             "Describe a day in the life of someone who loves {}.",
             "What would a poem about {} say? Write it."]


@dataclass(frozen=True)
class SourceFile:
    path: str   # relative to site-packages
    text: str
    rename: tuple[tuple[str, str], ...]  # (old, new) identifiers, one per turn


@dataclass
class Conversation:
    """One session: its file, and the messages so far (user turns, the model's answers)."""
    session_id: str
    file: SourceFile
    messages: list[dict] = field(default_factory=list)


def site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def source_files(count: int, min_lines: int, max_lines: int, turns: int = 1,
                 offset: int = 0) -> list[SourceFile]:
    """`count` files of min..max lines (sorted paths, every k-th so packages vary, shifted by
    `offset` so rounds can use fresh files), each with `turns` identifiers to rename (defined
    names used at least twice)."""
    root = site_packages()
    found = []
    for path in sorted(glob.glob(os.path.join(root, "*", "*.py"))):
        rel = os.path.relpath(path, root)
        if rel.startswith("_") or "/_" in rel or rel.startswith("loomserve"):
            continue
        try:
            text = open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError):
            continue
        lines = text.splitlines()
        if not (min_lines <= len(lines) <= max_lines) or max(map(len, lines)) > 100:
            continue
        names = [n for n in dict.fromkeys(re.findall(r"^\s*(?:def|class)\s+(\w+)", text, re.M))
                 if len(re.findall(rf"\b{n}\b", text)) >= 2 and not n.startswith("__")]
        if len(names) >= turns:
            found.append(SourceFile(rel, text, tuple((n, _renamed(n)) for n in names[:turns])))
    if len(found) < count:
        raise RuntimeError(f"only {len(found)} files of {min_lines}-{max_lines} lines")
    step = len(found) / count
    return [found[(int(i * step) + offset) % len(found)] for i in range(count)]


def _renamed(name: str) -> str:
    return name.upper() if name[:1].islower() else name + "V2"


def edit_message(f: SourceFile) -> list[dict]:
    old, new = f.rename[0]
    return [{"role": "user", "content": (
        f"Here is the file `{f.path}`:\n\n```python\n{f.text}```\n\n"
        f"Repeat the file above exactly, line by line, changing `{old}` to `{new}`. "
        "Output only the file.")}]


def session_turn(conv: Conversation, turn: int) -> list[dict]:
    """The messages of turn `turn` (0-based): the history, then the re-read file."""
    f = conv.file
    old, new = f.rename[turn]
    ask = (f"I re-read `{f.path}`:\n\n```python\n{f.text}```\n\n"
           f"Repeat the file exactly, line by line, changing `{old}` to `{new}`. "
           "Output only the file.")
    return conv.messages + [{"role": "user", "content": ask}]


def control_message(i: int) -> list[dict]:
    q = QUESTIONS[(i // len(TOPICS)) % len(QUESTIONS)]
    return [{"role": "user", "content": q.format(TOPICS[i % len(TOPICS)])}]


def edit_set(streams: int, distinct: int = 8, offset: int = 0) -> list[list[dict]]:
    """`streams` edit prompts over `distinct` files (streams on one file share its prefix)."""
    files = source_files(min(distinct, streams), 150, 250, offset=offset)
    distinct = len(files)
    return [edit_message(files[i % distinct]) for i in range(streams)]


def sessions(streams: int, turns: int, offset: int = 0) -> list[Conversation]:
    files = source_files(streams, 80, 140, turns, offset)
    return [Conversation(f"spec-bench-{i}", f) for i, f in enumerate(files)]


def control_set(streams: int, offset: int = 0) -> list[list[dict]]:
    return [control_message(offset + i) for i in range(streams)]
