"""One choice of one request: its tokens, KV progress and sampling state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from server.engine.stop_checker import StopChecker


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not holding KV blocks (new, or preempted)
    RUNNING = "running"  # holds KV blocks, scheduled every step
    FORK_PENDING = "fork_pending"  # n>1 child waiting for its parent's prefill to finish
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # choice index
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    admit_order: int = -1  # larger = admitted later = first preemption victim
    generator: torch.Generator | None = None  # per-choice seeded generator
    stop_checker: StopChecker | None = None
    fork_children: list[Sequence] = field(default_factory=list)  # forked from this one after its prefill
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run before the next sample (1 when decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_uncomputed == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def width(self) -> int:
        """Batch slots this sequence will occupy (itself + children it will fork)."""
        return 1 + len(self.fork_children)
