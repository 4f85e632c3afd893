"""Shared helpers of the engine tests: a small real engine on CPU and a collector of its streams.

Engines here run their core on a thread (`in_process=True`) unless a test asks for the core process."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from server.api.async_engine import AsyncEngine
from server.api.choice_stream import ChoiceStream
from server.api.outputs import ChoiceDelta, RequestOutput, TokenLogprob
from server.engine.engine import EngineConfig
from server.engine.outputs import SeqUpdate
from server.engine.sampling_params import SamplingParams

TINY = dict(model="tiny", device="cpu", dtype="float32", block_size=16, num_blocks=256, max_num_seqs=16,
            max_num_batched_tokens=256, attention_backend="torch")


def make_engine(in_process: bool = True, **overrides) -> AsyncEngine:
    engine = AsyncEngine(EngineConfig(**{**TINY, **overrides}), in_process=in_process)
    engine.start()
    return engine


@contextmanager
def started_engine(in_process: bool = True, **cfg):
    """An AsyncEngine of exactly `cfg` (no defaults added), started, shut down on exit."""
    engine = AsyncEngine(EngineConfig(**cfg), in_process=in_process)
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown(timeout=5)


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class Result:
    choices: dict[int, Choice] = field(default_factory=dict)
    outputs: list[RequestOutput] = field(default_factory=list)
    error: str | None = None


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams) -> Result:
    res = Result()
    async for out in engine.generate(request_id, prompt, params):
        res.outputs.append(out)
        res.error = out.error
        for d in out.deltas:
            c = res.choices.setdefault(d.index, Choice())
            c.text += d.text
            c.token_ids += d.token_ids
            c.logprobs += d.logprobs or []
            if d.finish_reason is not None:
                assert c.finish_reason is None, "a choice finished twice"
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    assert res.outputs[-1].finished
    return res


def run_all(engine: AsyncEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> list[Result]:
    """Run requests concurrently on one event loop."""

    async def main():
        return await asyncio.gather(*(collect(engine, *r) for r in requests))

    return asyncio.run(main())


def run_one(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams) -> Result:
    return run_all(engine, [(request_id, prompt, params)])[0]


def wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def stream_choice(tokenizer, token_ids: list[int], params: SamplingParams, per_update: int = 1,
                  eos_token_ids: frozenset[int] = frozenset()) -> list[ChoiceDelta]:
    """One choice's deltas on the API side, fed `per_update` ids per SeqUpdate with the core's finish rules
    (stop token ids, EOS, max_tokens); stops at the first finished delta."""
    choice = ChoiceStream(0, params, tokenizer, lambda t: tokenizer.decode([t]))
    deltas, n = [], 0
    while n < len(token_ids):
        ids = token_ids[n:n + per_update]
        reason, stop_id = None, None
        for i, t in enumerate(ids):
            if t in params.stop_token_ids or (t in eos_token_ids and not params.ignore_eos):
                reason, stop_id, ids = "stop", t if t in params.stop_token_ids else None, ids[:i + 1]
            elif n + i + 1 >= params.max_tokens:
                reason, ids = "length", ids[:i + 1]
            if reason:
                break
        n += len(ids)
        delta, _ = choice.apply(SeqUpdate("r", 0, ids, None, reason, stop_id))
        deltas.append(delta)
        if delta.finish_reason:
            break
    return deltas
