"""Shared helpers of the engine tests: a small real engine on CPU and a collector of its streams."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from server.engine.engine import AsyncEngine, EngineConfig
from server.engine.outputs import RequestOutput, TokenLogprob
from server.engine.sampling_params import SamplingParams


def make_engine(**overrides) -> AsyncEngine:
    cfg = dict(model="tiny", device="cpu", dtype="float32", block_size=16, num_blocks=256,
               max_num_seqs=16, max_num_batched_tokens=256, attention_backend="torch")
    cfg.update(overrides)
    engine = AsyncEngine(EngineConfig(**cfg))
    engine.start()
    return engine


@contextmanager
def started_engine(**cfg):
    """An AsyncEngine of exactly `cfg` (no defaults added), started, shut down on exit."""
    engine = AsyncEngine(EngineConfig(**cfg))
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
