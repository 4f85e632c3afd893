"""Admission of one OpenAI request, before its status line: bounded work, then a place in the queue.

RequestLimits bounds what one request may ask for (each refusal a 400 naming the field and the limit);
AdmissionGate reserves the request's queue places at once, so a request that cannot be queued gets its 429
(with Retry-After) or 503 before any byte of a 200, streaming or not. A reservation is taken back one
engine request at a time, in the same turn of the event loop as that request's registration in the engine
(so the engine's own count and the gate's never both miss it), and what is left of it is released when the
response ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.api.async_engine import RequestRejected
from server.api.errors import APIError
from server.engine.sampling_params import SamplingParams

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds; each has a `pagewalk serve` flag of the same name (README "Reliability")."""

    max_stop_strings: int = 64
    max_stop_string_length: int = 256  # characters
    max_prompts: int = 128  # prompts of one /v1/completions request
    max_choices: int = 256  # prompts x n
    max_logprob_entries: int = 1 << 20  # choices x tokens x (1 + logprobs): the response's logprob records
    max_request_tokens: int = 1 << 20  # choices x (prompt + max_tokens), summed over prompts
    max_seqs_per_request: int | None = None  # choices one request has in the engine at once; None: half
    #                                          of max_num_seqs (fair admission)

    def seqs_per_request(self, max_num_seqs: int) -> int:
        return self.max_seqs_per_request or max(1, max_num_seqs // 2)


def check_prompt_count(limits: RequestLimits, count: int) -> None:
    """400 for more prompts than a request may carry; checked before any prompt is tokenized, so that the
    work a refused request costs stays bounded by the limit (10x the limit was tokenized first: a review)."""
    if count > limits.max_prompts:
        _refuse("prompt", f"{count} prompts", f"max_prompts={limits.max_prompts}")


def check_limits(limits: RequestLimits, engine, prompts: list[list[int]], params: SamplingParams,
                 logprobs_param: str = "logprobs", tokens_param: str = "max_tokens",
                 prompt_ks: dict[str, int] | None = None) -> None:
    """400 for a request whose work exceeds a limit or the whole KV cache. `prompt_ks`: the lists of
    prompt-token logprobs the response carries, the field that sets k -> k (completions' echo with
    logprobs, and prompt_logprobs, may both); None: prompt_logprobs' own, if the params ask."""
    if len(params.stop) > limits.max_stop_strings:
        _refuse("stop", f"{len(params.stop)} stop strings", f"max_stop_strings={limits.max_stop_strings}")
    longest_stop = max((len(s) for s in params.stop), default=0)
    if longest_stop > limits.max_stop_string_length:
        _refuse("stop", f"a stop string of {longest_stop} characters",
                f"max_stop_string_length={limits.max_stop_string_length}")
    check_prompt_count(limits, len(prompts))
    choices = len(prompts) * params.n
    if choices > limits.max_choices:
        _refuse("n", f"{len(prompts)} prompts x n={params.n} = {choices} choices",
                f"max_choices={limits.max_choices}")
    if prompt_ks is None:
        prompt_ks = {} if params.prompt_logprobs is None else {"prompt_logprobs": params.prompt_logprobs}
    _check_prompt_forward(engine, prompts, prompt_ks)
    prompt_tokens = sum(len(p) for p in prompts)
    _check_logprob_entries(limits, choices, params, prompt_tokens, prompt_ks, logprobs_param)
    total = params.n * (prompt_tokens + len(prompts) * params.max_tokens)
    what = f"{total} tokens (n x (prompt + max_tokens), over all prompts)"
    # KV positions: a choice's last token is sampled and never forwarded (the core's _check_fits), so a
    # scored prompt (max_tokens 1, dropped) as long as a cache of max_model_len tokens fits (a review)
    positions = total - params.n * len(prompts)
    if positions > engine.capacity_tokens:
        _refuse(tokens_param, f"{positions} KV positions (n x (prompt + max_tokens - 1), over all prompts)",
                f"the KV cache capacity of {engine.capacity_tokens} tokens")
    if total > limits.max_request_tokens:
        _refuse(tokens_param, what, f"max_request_tokens={limits.max_request_tokens}")


def _check_prompt_forward(engine, prompts: list[list[int]], prompt_ks: dict[str, int]) -> None:
    """Prompt logprobs come from one dense forward over the prompt, of at most max_num_batched_tokens."""
    longest = max(len(p) for p in prompts)
    budget = engine.config.max_num_batched_tokens
    if prompt_ks and longest > budget:
        field = "prompt_logprobs" if "prompt_logprobs" in prompt_ks else "echo"  # else: echo with logprobs
        raise APIError(400, f"{field} asks for the prompt's logprobs, which come from one forward over the "
                            f"prompt of at most max_num_batched_tokens ({budget}) tokens; this prompt has "
                            f"{longest}.", field, "request_too_large")


def _check_logprob_entries(limits: RequestLimits, choices: int, params: SamplingParams, prompt_tokens: int,
                           prompt_ks: dict[str, int], logprobs_param: str) -> None:
    """The response's logprob records: each choice's tokens x (1 + logprobs), and each prompt list's prompt
    tokens x (1 + k) per choice; a refusal names the field asking for the most."""
    asked = {field: params.n * prompt_tokens * (1 + k) for field, k in prompt_ks.items()}
    if params.logprobs is not None:
        generated = choices * params.max_tokens * (1 + params.logprobs)
        asked[logprobs_param] = asked.get(logprobs_param, 0) + generated
    entries = sum(asked.values())
    if entries > limits.max_logprob_entries:
        field = max(asked, key=asked.get)
        _refuse(field, f"{entries} logprob entries (choices x tokens x (1 + logprobs), and prompt tokens x "
                       f"(1 + k) for the prompt's)", f"max_logprob_entries={limits.max_logprob_entries}; "
                f"lower max_tokens, n, the prompt or {field}")


def _refuse(param: str, what: str, limit: str) -> None:
    raise APIError(400, f"This request asks for {what}, over the limit of {limit}.", param,
                   "request_too_large")


class Reservation:
    """Queue places held for one request's engine requests that are not in the engine yet."""

    __slots__ = ("gate", "left")

    def __init__(self, gate: AdmissionGate, count: int):
        self.gate, self.left = gate, count

    def take(self) -> None:
        """One engine request is being registered now (call in the same turn as engine.generate's start)."""
        if self.left:
            self.left -= 1
            self.gate.pending -= 1

    def release(self) -> None:
        self.gate.pending -= self.left
        self.left = 0


class AdmissionGate:
    """The engine counts the requests it holds; the gate adds those admitted here and not handed over yet
    (a streamed request's prompts reach the engine after its status line; later prompts of a request
    wait for a place in its window)."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def pending(self) -> int:
        """Queue places reserved and not handed over; kept on the engine, whose drain waits for them."""
        return self.engine.reserved

    @pending.setter
    def pending(self, value: int) -> None:
        self.engine.reserved = value

    def reserve(self, prompts: list[list[int]], params: SamplingParams) -> Reservation:
        engine = self.engine
        limit = engine.max_request_prompts  # with several API servers, the smallest part of --max-waiting
        if len(prompts) > max(1, limit):
            raise APIError(400, f"{len(prompts)} prompts in one request exceed the waiting queue "
                                f"({engine.request_prompts_bound}); send at most {limit}.", "prompt")
        try:  # 503 stopping or dead, 400 a prompt too long for the cache, 429 a full queue
            engine.reserve_places([len(ids) for ids in prompts], params)
        except RequestRejected as e:
            raise rejected_to_api_error(e) from None
        return Reservation(self, len(prompts))


def rejected_to_api_error(e: RequestRejected) -> APIError:
    """AsyncEngine's refusal as the HTTP error: its status, message and field (429 with Retry-After)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
    return APIError(e.status, e.message, e.param, headers=headers)
