"""The records the engine core exchanges with the API process: ints, floats and short strings only.

They cross a process boundary as msgpack (msgspec), so they are msgspec Structs; the same objects are
passed as they are when the core runs in-process. Text never appears here: the API process detokenizes
and applies stop strings; the core checks EOS, stop token ids and max_tokens.
"""

from __future__ import annotations

import msgspec

from server.engine.sampling_params import SamplingParams

STRUCTURED_OUTPUT_FAILED = "structured_output"  # SeqUpdate.error_kind
BAD_WORDS_CONFLICT = "bad_words"  # SeqUpdate.error_kind: bad_words left nothing else to draw

# one new token's logprob and the top-k (token id, logprob) pairs, best first
TokenLogprobs = tuple[float, list[tuple[int, float]]]
# one prompt token's logprob, its rank in the vocabulary (1: the most likely) and the top-k, best first
PromptTokenLogprobs = tuple[float, int, list[tuple[int, float]]]


class EngineRequest(msgspec.Struct, tag="add"):
    """A request the API process admitted: prompt ids and sampling parameters (validated there)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() of the API process; read back there only
    # the client's request it is a prompt of (a completion of several prompts is an engine request per
    # prompt), whose choices count together against a step's grammar budget; None: itself
    group: str | None = None


class SeqUpdate(msgspec.Struct, array_like=True, gc=False):
    """What one choice did in one step: its new token ids, and how it ended if it did. Untracked by the
    garbage collector (it holds no reference back to itself): the API process decodes one per stream per
    step, and tracked ones would make every collection longer (10-15% of its CPU at 256 streams, py-spy)."""

    request_id: str
    index: int  # choice index in [0, n)
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per new token when the request asked for logprobs
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "error"
    stop_token_id: int | None = None  # finish "stop" on a stop token id; None with EOS. The last new id.
    error: str | None = None  # finish "error": what failed
    # on a choice's first update when the request asked for prompt logprobs: one per prompt token, None first
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None
    # on a choice's first update: time.monotonic() of the first step that ran the request (the clock is
    # system-wide, so the API process compares it with its arrival time)
    scheduled_time: float | None = None
    # on a choice's first update: time.monotonic() when the core took the request in (between its steps)
    received_time: float | None = None
    # finish "error" caused by the request itself, not the engine: STRUCTURED_OUTPUT_FAILED (its grammar does
    # not compile in the core, holds every step too long, or allows no token the model can draw) or
    # BAD_WORDS_CONFLICT (its bad_words ban every token its grammar, allowed_token_ids or the model leave).
    # The API answers it with a 400, which clients do not retry; None: the engine's failure, a 500
    error_kind: str | None = None


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """The core's state after a step, and what that step did."""

    running: int  # requests with a choice holding KV blocks
    waiting: int  # requests in the core, none of their choices running
    free_blocks: int  # cached ones included
    used_blocks: int
    cached_blocks: int
    prefix_hit_rate: float
    num_prefill_tokens: int = 0  # prompt (and recomputed) tokens run this step
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, all time
    prefix_hits: int = 0  # of those, tokens served from it
    generated_tokens: int = 0  # output tokens the core handed out, all time (every client's)
    preemptions: int = 0  # all time
    prefill_tokens: int = 0  # prompt (and recomputed) tokens run, all time
    steps: int = 0  # steps that ran tokens, all time
    prompt_steps: int = 0  # of them, those with prompt tokens (decode rows beside them or not), all time


class StepUpdate(msgspec.Struct, tag="step", gc=False):
    """One message per step (or per batch of adds/aborts when idle) to each client: every choice of its
    requests that changed, the core's stats, and how many of the running requests are the client's."""

    updates: list[SeqUpdate]
    stats: CoreStats
    client_running: int = 0

