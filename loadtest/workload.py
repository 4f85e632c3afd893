"""The workload: which prompts are sent, how long their outputs are, and when each one arrives.

Completions prompts are token-id lists of exactly the requested length, drawn uniformly from a safe id range
(`--vocab-range`, default 32..126: printable ASCII for byte-level tokenizers such as pagewalk's `tiny`).
Chat prompts are text: random lowercase letters. How many tokens the server counts for them is measured once
(client.calibrate_chat: the template's own tokens, and the tokens a letter, 1 on a byte-level tokenizer), and
each prompt has the letters that make `input_len` tokens: exactly on a byte-level tokenizer, about so on a
BPE one (the report's input tokens are the server's count).

Arrivals follow vLLM's `bench serve`: gaps are gamma-distributed with shape `burstiness` and mean
`1 / request_rate` (burstiness 1 = Poisson); an infinite rate sends everything at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: list[int] | str  # token ids (completions) or text (chat)
    input_len: int  # prompt tokens the server is expected to see
    output_len: int  # max_tokens, with ignore_eos: the exact output length


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int  # inclusive

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """'16' or '8,64' (inclusive uniform range)."""
        parts = [int(p) for p in text.replace(":", ",").split(",") if p.strip()]
        if len(parts) == 1:
            parts = parts * 2
        if len(parts) != 2 or parts[0] < 1 or parts[1] < parts[0]:
            raise ValueError(f"expected N or LOW,HIGH with 1 <= LOW <= HIGH, got {text!r}")
        return cls(parts[0], parts[1])

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]


def token_prompt(rng: np.random.Generator, length: int, vocab_range: tuple[int, int]) -> list[int]:
    low, high = vocab_range
    return [int(x) for x in rng.integers(low, high + 1, size=length)]


def text_prompt(rng: np.random.Generator, length: int) -> str:
    letters = rng.integers(ord("a"), ord("z") + 1, size=length)
    return "".join(chr(int(c)) for c in letters)


@dataclass(frozen=True)
class ChatCalibration:
    """What the server counts for a chat prompt of n random letters: template + per_char * n tokens."""

    template: float = 0.0  # the chat template's tokens around the message
    per_char: float = 1.0  # tokens a letter: 1 on a byte-level tokenizer

    def letters(self, input_len: int) -> int:
        """The letters of a prompt of `input_len` tokens; ValueError where the template alone takes them."""
        if input_len <= self.template + self.per_char / 2:
            raise ValueError(f"input_len {input_len} must exceed the chat template's {self.template:g} "
                             "tokens")
        return max(1, round((input_len - self.template) / self.per_char))


def build_workload(
    num_requests: int,
    input_lens: LengthRange,
    output_lens: LengthRange,
    seed: int,
    endpoint: str = "completions",
    vocab_range: tuple[int, int] = (32, 126),
    chat: ChatCalibration = ChatCalibration(),
) -> list[RequestSpec]:
    """`num_requests` specs; the same seed and length ranges give the same prompts and lengths. Each prompt
    draws from its own stream keyed by (seed, ranges, index): with one stream for all, a run at twice the
    input length with the same seed sent the earlier run's prompts joined in pairs (and at half, their
    first halves), prefix-cache hits the workload did not mean."""
    key = [seed, input_lens.low, input_lens.high, output_lens.low, output_lens.high]
    rng = np.random.default_rng(key)
    ins = input_lens.sample(rng, num_requests)
    outs = output_lens.sample(rng, num_requests)
    specs = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        prompt_rng = np.random.default_rng([*key, i])
        if endpoint == "chat":
            prompt: list[int] | str = text_prompt(prompt_rng, chat.letters(n_in))
        else:
            prompt = token_prompt(prompt_rng, n_in, vocab_range)
        specs.append(RequestSpec(index=i, prompt=prompt, input_len=n_in, output_len=n_out))
    return specs


def check_arrivals(request_rate: float, burstiness: float) -> None:
    """ValueError unless request_rate > 0 (inf: all at once) and burstiness is a finite number > 0 (NaN
    compares false both ways: it passed a `<= 0` test and sent everything at once)."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if not 0 < burstiness < math.inf:
        raise ValueError(f"burstiness must be a number > 0, got {burstiness}")


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is released (non-decreasing, first is 0)."""
    check_arrivals(request_rate, burstiness)
    if math.isinf(request_rate) or num_requests == 0:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed + 1)  # independent of the prompt stream
    theta = 1.0 / (request_rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)
    return [0.0] + [float(t) for t in np.cumsum(gaps)]
