"""Running one OpenAI request on the engine: admission, one engine request per prompt (a window of them
at a time), merged outputs.

Closing the merged iterator (client gone, server stopping) closes every engine iterator, which aborts
those requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request

from server.api.admission import Reservation, check_limits, rejected_to_api_error
from server.api.async_engine import RequestRejected
from server.api.errors import APIError
from server.api.outputs import ChoiceDelta, RequestOutput, TokenLogprob
from server.api.protocol import Usage
from server.engine.outputs import BAD_WORDS_CONFLICT, STRUCTURED_OUTPUT_FAILED
from server.engine.sampling_params import SamplingParams


@dataclass
class ChoiceState:
    """Everything one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list | None = None  # ChoiceDelta.prompt_logprobs, from the choice's first delta

    def add(self, delta: ChoiceDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass
class StreamedChoice:
    """What a streamed choice keeps of what it produced: the text offset of its next token (logprob
    offsets) and its token count (usage); the text itself is already sent, and keeping it costs a copy per
    event. The offset sums the tokens' strings, as the unstreamed response's offsets do (logprobs.py), not
    the text sent: text that might start a stop string is held back and sent with a later token, whose
    offset must still count it."""

    text_offset: int = 0
    num_tokens: int = 0

    def add(self, delta: ChoiceDelta) -> None:
        if delta.logprobs:
            self.text_offset += sum(len(lp.token) for lp in delta.logprobs)
        else:
            self.text_offset += len(delta.text)
        self.num_tokens += len(delta.token_ids)


@dataclass
class RunningUsage:
    """A streamed request's usage so far, which each of its chunks carries with
    stream_options.continuous_usage_stats: counted as usage() counts the final one (every prompt once, the
    tokens of all choices summed), so the last chunk's equals it."""

    prompt_tokens: int
    completion_tokens: int = 0

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens)


class CountedChoice(StreamedChoice):
    """A StreamedChoice whose tokens also count into its request's RunningUsage; a class of its own so that
    a stream without continuous usage does no more per delta than before."""

    def __init__(self, text_offset: int, running: RunningUsage):
        super().__init__(text_offset)
        self.running = running

    def add(self, delta: ChoiceDelta) -> None:
        super().add(delta)
        self.running.completion_tokens += len(delta.token_ids)


def streamed_choices(text_offsets: list[int], running: RunningUsage | None) -> list[StreamedChoice]:
    """One StreamedChoice per choice (its first token's text offset given), counting into `running` where
    the chunks carry the usage so far."""
    if running is None:
        return [StreamedChoice(offset) for offset in text_offsets]
    return [CountedChoice(offset, running) for offset in text_offsets]


def tokens_field(limits: dict[str, int | None], n: int | None, prompt_field: str) -> str:
    """The field a refusal of a request's total tokens names: the first token limit the client sent
    (`limits`: field -> value, None unsent), else what makes the total (n, or the prompt with one choice)."""
    sent = next((field for field, value in limits.items() if value is not None), None)
    return sent or ("n" if (n or 1) > 1 else prompt_field)


def admit(request: Request, prompts: list[list[int]], params: SamplingParams,
          logprobs_param: str = "logprobs", tokens_param: str = "max_tokens",
          prompt_ks: dict[str, int] | None = None) -> Reservation:
    """The request's bounds (400 naming the field: tokens_param for the request's total tokens, a field
    the client sent; prompt_ks: see check_limits), then its queue places (429 queue full, 503 stopping),
    all before the status line. The caller hands the reservation to merged_outputs and releases it when the
    response ends."""
    state = request.app.state
    check_limits(state.limits, state.engine, prompts, params, logprobs_param, tokens_param, prompt_ks)
    return state.admission.reserve(prompts, params)


async def merged_outputs(engine, engine_id: str, response_id: str, prompts: list[list[int]],
                         params: SamplingParams, reservation: Reservation | None = None,
                         max_seqs: int | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (prompt index, output) from one engine request per prompt, in arrival order (their group:
    `engine_id`; labelled with `response_id`). At most `max_seqs` choices (at least one prompt) are in the
    engine at once, so one request of many prompts queues behind its own window and cannot hold the whole
    queue ahead of smaller requests."""
    take = reservation.take if reservation is not None else _nothing
    if len(prompts) == 1:
        take()  # the same turn as generate's registration: no await in between
        async with aclosing(engine.generate(engine_id, prompts[0], params, reservation is not None,
                                            label=(response_id, 0))) as gen:
            async for out in gen:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    window = asyncio.Semaphore(max(1, (max_seqs or len(prompts) * params.n) // params.n))
    arrival = time.monotonic()  # every prompt's: the wait for a place in the window is latency too

    async def pump(i: int, ids: list[int]) -> None:
        try:
            async with window:
                take()
                label = (response_id, i * params.n)
                gen = engine.generate(f"{engine_id}-{i}", ids, params, reservation is not None,
                                      group=engine_id, label=label, arrival_time=arrival)
                async with aclosing(gen):
                    async for out in gen:
                        queue.put_nowait((i, out))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _nothing() -> None:
    pass


async def collect_choices(engine, engine_id: str, response_id: str, prompts: list[list[int]],
                          params: SamplingParams, states: list[ChoiceState],
                          reservation: Reservation | None = None, max_seqs: int | None = None
                          ) -> list[ChoiceState]:
    """Run a non-streaming request to the end: choice j of prompt i accumulates into states[i * n + j].
    Engine failures become a 500 APIError, refusals their 4xx."""
    n = params.n
    try:
        async with aclosing(merged_outputs(engine, engine_id, response_id, prompts, params, reservation,
                                           max_seqs)) as outs:
            async for i, out in outs:
                if out.error:
                    raise engine_error(out)
                for d in out.deltas:
                    states[i * n + d.index].add(d)
    except RequestRejected as e:
        raise rejected_to_api_error(e) from None
    return states


def usage(prompts: list[list[int]], states: list[ChoiceState] | list[StreamedChoice]) -> Usage:
    """Each prompt is counted once however many choices it has."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(s.num_tokens if isinstance(s, StreamedChoice) else len(s.token_ids)
                            for s in states)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def engine_error(out: RequestOutput) -> APIError:
    """The engine's failure, a 500; or the request's own (its structured output failed in the engine), a 400
    that clients do not retry (the openai SDK sent such a request three times, failing each the same way)."""
    if out.error_kind == STRUCTURED_OUTPUT_FAILED:
        return APIError(400, f"The structured output failed this request: {out.error}",
                        code="structured_output_failed")
    if out.error_kind == BAD_WORDS_CONFLICT:
        return APIError(400, f"This request's constraints conflict: {out.error}", "bad_words",
                        "bad_words_conflict")
    return APIError(500, f"The engine failed this request: {out.error}", code="engine_error")
