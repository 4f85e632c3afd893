"""One choice of one request: the single record of its progress (tokens, K/V computed, batch row).

The scheduler advances it, and only the scheduler: `num_computed_tokens` when it schedules a chunk (the
steps run in stream order, so a scheduled chunk counts as written for the next step's plan), `num_pending`
and `token_ids` in `Scheduler.postprocess` when a sampled token reaches the host. With asynchronous
scheduling a step is planned while the previous one still runs: its sampled token is then pending (on the
device, already the next step's input) and counted in `num_tokens` but not yet in `token_ids`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from server.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not holding KV blocks (new, or preempted)
    RUNNING = "running"  # holds KV blocks and a batch row, scheduled every step
    FORK_PENDING = "fork_pending"  # n>1 child waiting for its parent's prefill to finish
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # choice index
    prompt_token_ids: list[int]
    params: SamplingParams
    seed_key: int = 0  # 31-bit key of this choice's sampling stream (counter-based on the device)
    held_back: list[int] = field(default_factory=list)  # ids min_tokens keeps out: EOS, stop_token_ids
    token_ids: list[int] = field(default_factory=list)  # prompt + generated tokens known on the host
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are written by the steps launched so far
    num_pending: int = 0  # sampled by a launched step, not yet on the host
    row: int = -1  # the persistent batch row it holds while RUNNING
    fork_children: list[Sequence] = field(default_factory=list)  # forked from this one after its prefill
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    times_passed: int = 0  # admissions past it while it waited (Scheduler._admit_waiting bounds them)
    # the prompt's prefix-cache keys (KVCacheManager.prefix_keys), computed when the request arrives, so the
    # admission in a step only looks them up; dropped once admitted (32 admissions over a 496-token cached
    # prefix: the step's schedule() 1.02 -> 0.68 ms, add_request +0.45 ms outside the step; CI CPU, 3 runs)
    prefix_keys: list = field(default_factory=list)
    matcher: object = None  # a structured output's llguidance LLMatcher (server/engine/grammar.py)
    lane: int | None = None  # the compile its matcher copies (grammar.MatcherFuture: copies mask in turn)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @cached_property
    def sample_flags(self) -> int:
        """What sampling this sequence needs (server.engine.sampler flags), OR-ed per step by the runner."""
        from server.engine.sampler import step_flags  # the sampler imports torch; sequences need not

        return step_flags(self.params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence has, the pending one included."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

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
        """Batch rows this sequence will occupy (itself + children it will fork)."""
        return 1 + len(self.fork_children)
