"""POST /v1/completions: prompt = str | list[str] | list[int] | list[list[int]]; choices indexed
across prompts x n (choice index = prompt_index * n + engine choice index)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import cached_property

from fastapi import APIRouter, Request, Response

from server.api.admission import Reservation, check_prompt_count
from server.api.engine_stream import (
    ChoiceState,
    RunningUsage,
    admit,
    collect_choices,
    engine_error,
    merged_outputs,
    streamed_choices,
    tokens_field,
    usage,
)
from server.api.errors import APIError
from server.api.logprobs import (
    completion_logprobs,
    decoded_tokens,
    echo_logprobs,
    joined,
    vllm_prompt_logprobs,
)
from server.api.openapi_bodies import request_body
from server.api.outputs import ChoiceDelta, token_id_string
from server.api.parsing import check_model, parse_body
from server.api.prompts import check_context_length, check_cut_room, truncated
from server.api.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from server.api.request_ids import engine_request_id, new_request_id, resolve_request_id
from server.api.request_work import run_request_work
from server.api.sampling import DEFAULT_COMPLETION_MAX_TOKENS, check_token_ids, sampling_params
from server.api.streaming import (
    ChunkFrame,
    UsageChunkFrame,
    build_response,
    chunk_frame,
    job_response,
    json_member,
    json_str,
    sse_event,
)
from server.api.structured_output import Grammar, request_grammar
from server.engine.sampling_params import SamplingParams

router = APIRouter()


@dataclass
class CompletionJob:
    """One validated, admitted /v1/completions request."""

    engine: object
    req: CompletionRequest
    response_id: str  # the response's id: "cmpl-" + the request id
    created: int
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: SamplingParams
    reservation: Reservation | None = None  # its queue places (admit)
    max_seqs: int | None = None  # choices in the engine at once
    # echo with max_tokens 0 (OpenAI's legacy way to score a prompt, as vLLM serves it): the engine samples
    # one token for the prompt's logprobs, and the answer is the echoed prompt alone
    scores_prompt: bool = False
    engine_id: str = field(init=False)  # the engine's id for it (its prompts': + "-{index}")

    def __post_init__(self) -> None:
        self.engine_id = engine_request_id(self.response_id)

    def new_states(self) -> list[ChoiceState]:
        n = self.params.n
        return [ChoiceState(text=self.prompt_texts[i // n] if self.req.echo else "")
                for i in range(len(self.prompts) * n)]

    def choice(self, index: int, text: str, delta: ChoiceDelta | None, offset: int,
               token_ids: list[int] | None, with_prompt_ids: bool) -> CompletionChoice:
        ids_wanted = bool(self.req.return_token_ids)
        logprobs = None
        if self.req.logprobs is not None and delta is not None:
            logprobs = completion_logprobs(delta.logprobs or [], offset)
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs,
            finish_reason=delta.finish_reason if delta else None,
            stop_reason=delta.stop_reason if delta else None,
            token_ids=token_ids if ids_wanted else None,
            prompt_token_ids=self.prompts[index // self.params.n] if ids_wanted and with_prompt_ids else None)

    def first_offset(self, index: int) -> int:
        """text_offset of choice `index`'s first generated token: past the echoed prompt's token strings,
        as the echo's own offsets count them (a BOS or a skipped special token has a string and no text),
        so offsets never go back; 0 without echo."""
        if not self.req.echo:
            return 0
        if self.req.logprobs is None:  # no offsets: the echoed text's length
            return len(self.prompt_texts[index // self.params.n])
        token_string = self.token_string
        return sum(len(token_string(t)) for t in self.prompts[index // self.params.n])

    @cached_property
    def token_string(self) -> Callable[[int], str]:
        """A prompt token id -> its echo logprob entry's string: its text, or its id's string
        (return_tokens_as_token_ids), as the choices' entries are spelled."""
        return token_id_string if self.req.return_tokens_as_token_ids else self.engine.tokenizer.token_text

    def echo_logprobs(self, index: int, entries: list) -> CompletionLogprobs:
        return echo_logprobs(self.token_string, self.prompts[index // self.params.n], entries,
                             self.req.logprobs or 0)

    def echo_choice(self, index: int, prompt_logprobs: list | None) -> CompletionChoice:
        """The streamed echo of choice `index`'s prompt, with its logprobs when the core sent them."""
        c = self.choice(index, self.prompt_texts[index // self.params.n], None, 0, [], True)
        c.logprobs = None if prompt_logprobs is None else self.echo_logprobs(index, prompt_logprobs)
        return c

    def response(self, choices: list[CompletionChoice], usage_=None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.engine.model_name,
                                  choices=choices, usage=usage_)

    @cached_property
    def running_usage(self) -> RunningUsage | None:
        """The usage so far that every streamed chunk carries (continuous usage); None: they carry none."""
        return RunningUsage(sum(map(len, self.prompts))) if self.req.continuous_usage else None

    @cached_property
    def frame(self) -> ChunkFrame | UsageChunkFrame:
        return chunk_frame(self.response_id, "text_completion", self.created, self.engine.model_name,
                           self.req.include_usage, self.running_usage)

    def delta_event(self, index: int, delta: ChoiceDelta, offset: int, with_prompt_ids: bool) -> str:
        """The SSE event of one streamed delta: the bytes of frame.event(response([choice(...)])), built
        without pydantic when no logprobs are asked for (the per-token hot path)."""
        if self.req.logprobs is not None:
            choice = self.choice(index, delta.text, delta, offset, delta.token_ids, with_prompt_ids)
            return self.frame.event(self.response([choice]))
        if delta.finish_reason is None and delta.stop_reason is None and not self.req.return_token_ids:
            return (f'{self.frame.head}{{"index":{index},"text":{json_str(delta.text)},"logprobs":null,'
                    f'"finish_reason":null,"stop_reason":null}}{self.frame.tail}')
        parts = [self.frame.head, '{"index":', str(index), json_member("text", delta.text),
                 ',"logprobs":null', json_member("finish_reason", delta.finish_reason),
                 json_member("stop_reason", delta.stop_reason)]
        if self.req.return_token_ids:
            if with_prompt_ids:
                parts.append(json_member("prompt_token_ids", self.prompts[index // self.params.n]))
            parts.append(json_member("token_ids", delta.token_ids))
        parts.append("}" + self.frame.tail)
        return "".join(parts)


EXAMPLE = {"prompt": "Say hello", "max_tokens": 8}  # the schema's example body


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest, EXAMPLE))
async def create_completion(request: Request) -> Response:
    engine = request.app.state.engine
    req = await parse_body(request, CompletionRequest)
    check_model(engine, req.model)
    request_id = resolve_request_id(request, req.request_id)
    check_prompt_count(request.app.state.limits, _prompt_count(req.prompt))
    grammar = await request_grammar(request, req, engine.tokenizer)
    job = await run_request_work(request, _job, engine, req, grammar, request_id)
    job.reservation = admit(request, job.prompts, job.params,
                            tokens_param=tokens_field({"max_tokens": req.max_tokens}, req.n, "prompt"),
                            prompt_ks=_prompt_ks(req))
    job.max_seqs = request.app.state.limits.seqs_per_request(engine.config.max_num_seqs)
    return await job_response(request, req.stream, lambda: _stream(job), lambda: _complete(job),
                              job.reservation)


def _prompt_count(prompt: str | list) -> int:
    """A text, a list of texts, a list of ids (one prompt) or a list of id lists: how many prompts."""
    return 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)


def _job(engine, req: CompletionRequest, grammar: Grammar | None = None,
         request_id: str | None = None) -> CompletionJob:
    """`request_id`: the one resolve_request_id gave; None: a fresh one."""
    tok = engine.tokenizer
    prompt = req.prompt
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        prompts = [tok.encode(t, add_bos=req.add_special_tokens is not False) for t in texts]
        if not all(prompts):  # "" without a BOS: nothing for the model to read
            raise APIError(400, "prompt must not be empty: it tokenizes to no token.", "prompt")
    else:
        prompts = [prompt] if isinstance(prompt[0], int) else [list(p) for p in prompt]
        for ids in prompts:
            check_token_ids(ids, tok.vocab_size, "prompt")
        texts = [echo_text(tok, ids, req) for ids in prompts]
    cut, cut_to = truncated(prompts, req.truncate_prompt_tokens, engine.max_model_len)
    if cut_to is not None:  # a cut prompt's echo is what the model reads
        texts = [t if len(c) == len(p) else echo_text(tok, c, req)
                 for t, c, p in zip(texts, cut, prompts, strict=True)]
        prompts = cut
    if not req.detokenizes:  # no text, an echo's included (a prompt of ids was never decoded: echo_text)
        texts = [""] * len(prompts)
    scores_prompt = req.max_tokens == 0
    if scores_prompt and not req.echo:
        raise APIError(400, "max_tokens 0 generates nothing: it is only valid with echo (score the prompt).",
                       "max_tokens")
    if scores_prompt and req.min_tokens:  # checked against the 0 sent, before the one dropped token below
        raise APIError(400, f"min_tokens must be an integer in [0, max_tokens=0], got {req.min_tokens}",
                       "min_tokens")
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    completion = 0 if scores_prompt else max_tokens  # what the context must hold beside the prompt
    check_cut_room(cut_to, completion, engine.max_model_len, "max_tokens")
    check_context_length(engine, prompts, completion, "prompt")
    max_tokens = max(1, max_tokens)  # scoring: the one token sampled is dropped (the core never forwards it)
    params = sampling_params(req, max_tokens, req.logprobs, tok, engine.sampling_defaults, grammar)
    if req.echo and req.logprobs is not None:  # the echoed prompt comes with its logprobs
        params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
    response_id = f"cmpl-{request_id or new_request_id()}"
    return CompletionJob(engine, req, response_id, int(time.time()), prompts, texts, params,
                         scores_prompt=scores_prompt)


def _prompt_ks(req: CompletionRequest) -> dict[str, int]:
    """The prompt logprob lists the response carries (admission counts them): the echo's and vLLM's."""
    ks = {"logprobs": req.logprobs} if req.echo and req.logprobs is not None else {}
    if req.prompt_logprobs is not None:
        ks["prompt_logprobs"] = req.prompt_logprobs
    return ks


def echo_text(tok, ids: list[int], req: CompletionRequest) -> str:
    """The text an echo of prompt `ids` shows, decoded as the choices' text is ("" without echo, or where
    detokenize is false)."""
    return tok.decode(ids, req.skip_special_tokens is not False) if req.echo and req.detokenizes else ""


def _prompt_only(delta: ChoiceDelta) -> ChoiceDelta:
    """A scoring request's delta without its sampled token: no text, ids or logprobs; its end is the
    max_tokens 0 it asked for."""
    return ChoiceDelta(delta.index, "", [], [] if delta.logprobs is not None else None,
                       "length" if delta.finish_reason is not None else None, None, delta.prompt_logprobs)


async def _complete(job: CompletionJob) -> bytes:
    states = await collect_choices(job.engine, job.engine_id, job.response_id, job.prompts, job.params,
                                   job.new_states(), job.reservation, job.max_seqs)
    return await build_response(_response_body, job, states, heavy=job.req.logprobs is not None
                                or job.req.prompt_logprobs is not None)


def _response_body(job: CompletionJob, states: list[ChoiceState]) -> bytes:
    n = job.params.n
    choices = []
    for index, st in enumerate(states):
        if job.scores_prompt:  # the echoed prompt alone (new_states started it)
            st.text, st.token_ids, st.logprobs = job.prompt_texts[index // n], [], []
            st.finish_reason, st.stop_reason = "length", None
        base = job.first_offset(index)
        c = job.choice(index, st.text, None, base, st.token_ids, True)
        c.finish_reason, c.stop_reason = st.finish_reason, st.stop_reason
        if job.req.logprobs is not None:
            c.logprobs = completion_logprobs(st.logprobs, base)
            if job.req.echo and st.prompt_logprobs is not None:
                c.logprobs = joined(job.echo_logprobs(index, st.prompt_logprobs), c.logprobs)
        if job.req.prompt_logprobs is not None and st.prompt_logprobs is not None:
            c.prompt_logprobs = vllm_prompt_logprobs(decoded_tokens(job.engine.tokenizer, job.req),
                                                     job.prompts[index // n],
                                                     st.prompt_logprobs, job.req.prompt_logprobs)
        choices.append(c)
    resp = job.response(choices, usage(job.prompts, states))
    return resp.model_dump_json().encode()


async def _stream(job: CompletionJob) -> AsyncIterator[str]:
    n = job.params.n
    states = streamed_choices([job.first_offset(i) for i in range(len(job.prompts) * n)], job.running_usage)
    started = [False] * len(states)
    if job.req.echo and job.req.logprobs is None:
        for index in range(len(states)):
            started[index] = True
            echoed = job.choice(index, job.prompt_texts[index // n], None, 0, [], True)
            yield job.frame.event(job.response([echoed]))
    async with aclosing(merged_outputs(job.engine, job.engine_id, job.response_id, job.prompts, job.params,
                                       job.reservation, job.max_seqs)) as outs:
        async for i, out in outs:
            if out.error:
                raise engine_error(out)
            for d in out.deltas:
                index = i * n + d.index
                if job.scores_prompt:
                    d = _prompt_only(d)
                if job.req.echo and not started[index]:  # with logprobs: they came with this first delta
                    started[index] = True
                    yield job.frame.event(job.response([job.echo_choice(index, d.prompt_logprobs)]))
                offset = states[index].text_offset
                states[index].add(d)
                if d.text or d.token_ids or d.finish_reason:
                    event = job.delta_event(index, d, offset, not started[index])
                    started[index] = True
                    yield event
    if job.req.include_usage:
        yield sse_event(job.response([], usage(job.prompts, states)))
