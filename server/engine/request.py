"""One request inside the engine core: its n choices (Sequences) and when it arrived."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.engine.sampling_params import SamplingParams
from server.engine.sequence import Sequence


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    group: str | None = None  # EngineRequest.group
    seqs: list[Sequence] = field(default_factory=list)  # index order: seqs[i].index == i
    prompt_logprobs: list | None = None  # TokenLogprobs per prompt token (None first), when asked for
    scheduled_time: float | None = None  # time.monotonic() of the first step that ran it
    received_time: float | None = None  # time.monotonic() when add_request took it in

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]
