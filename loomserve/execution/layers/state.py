"""The execution-side view of linear/SSM-state groups (contract between runner and layers).

Each step the runner turns every seq's StateDirective (loomserve.execution.batch) into page copies done
once for the whole pool page (init_from -> running_block, or zeroing it), then hands each
linear layer a `StateBatch`: the seqs in batch order with their rows in the flattened tokens,
the page holding their live state and the checkpoints to take inside this chunk.

A linear layer's cache is a tuple of views into the packed pages, one per state tensor of the
layer's LinearStateSpec.state_shapes, each [num_blocks, *shape] (e.g. conv state
[num_blocks, conv_dim, kernel - 1] and recurrent state [num_blocks, heads, k_dim, v_dim]).
The layer, per seq: reads the state at `running_block`, consumes rows start..end, writes the
state after `n` tokens into page `dst` for each (n, dst) in `saves` (n counts tokens of the
whole sequence, so the save falls after row start + (n - start_pos) - 1), and finally writes the
state back into `running_block`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StateSeq:
    start: int  # first row of this seq in the flattened batch
    end: int  # one past its last row
    start_pos: int  # tokens the state has consumed before this chunk
    running_block: int
    saves: list[tuple[int, int]] = field(default_factory=list)  # (tokens consumed, dst page)

    @property
    def is_decode(self) -> bool:
        return self.end - self.start == 1


@dataclass
class StateBatch:
    seqs: list[StateSeq]
    pcp: object = None  # prefill context parallelism: the step's PcpSplit (rows are the whole batch's)

    @property
    def num_rows(self) -> int:
        return self.seqs[-1].end if self.seqs else 0
