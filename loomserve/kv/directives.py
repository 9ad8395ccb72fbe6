"""What the KV plane tells the execution plane about a request's recurrent state each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StateDirective:
    """Where one request's recurrent state (a linear/SSM-state group) lives and moves this step.

    The live state sits in page `running_block` and is updated in place as tokens are computed.
    Before the chunk: `init_from` copies a kept checkpoint page into it (a prefix hit), or
    `zero_init` clears it (a sequence starting at position 0); neither = continue from it.
    `saves` lists (n, page): once the state has consumed the first n tokens of the sequence
    (start_pos < n <= start_pos + len(token_ids), n block aligned), copy it into `page`. That is
    how checkpoints are taken inside a chunk without splitting the batch."""

    running_block: int
    init_from: int | None = None
    zero_init: bool = False
    saves: list[tuple[int, int]] = field(default_factory=list)
