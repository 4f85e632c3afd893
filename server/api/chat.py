"""POST /v1/chat/completions: messages -> chat template -> tokens; the first streamed chunk of every choice
carries role "assistant"."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from functools import cached_property

from fastapi import APIRouter, Request, Response

from server.api.admission import RequestLimits, Reservation
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
from server.api.forced_tool_calls import ForcedCalls, NamedCallStream, RequiredCallStream, forced_calls
from server.api.logprobs import chat_logprobs, decoded_tokens, vllm_prompt_logprobs
from server.api.openapi_bodies import request_body
from server.api.outputs import ChoiceDelta
from server.api.parsing import check_model, parse_body
from server.api.prompts import (
    chat_prompt_ids,
    check_context_length,
    check_cut_room,
    template_variables,
    truncated,
)
from server.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    DeltaToolCall,
    ToolCallFunction,
    ToolCallOut,
)
from server.api.request_ids import engine_request_id, new_request_id, resolve_request_id
from server.api.request_work import run_request_work
from server.api.sampling import sampling_params
from server.api.streaming import (
    ChunkFrame,
    UsageChunkFrame,
    build_response,
    chunk_frame,
    job_response,
    json_member,
    json_str,
    json_text,
    sse_event,
)
from server.api.structured_output import Grammar, request_grammar
from server.api.tool_calls import ToolCall, ToolCallStream
from server.api.tool_calls import parse as parse_tool_calls
from server.engine.sampling_params import SamplingParams

router = APIRouter()


@dataclass
class ChatJob:
    """One validated, admitted /v1/chat/completions request."""

    engine: object
    req: ChatCompletionRequest
    response_id: str  # the response's id: "chatcmpl-" + the request id
    created: int
    prompt: list[int]
    params: SamplingParams
    reservation: Reservation | None = None  # its queue places (admit)
    tool_call_parser: str | None = None  # the replies may hold tool calls, in this parser's format
    forced: ForcedCalls | None = None  # tool_choice "required" or named: the replies are calls
    engine_id: str = field(init=False)  # the engine's id for it (request_ids.engine_request_id)

    def __post_init__(self) -> None:
        self.engine_id = engine_request_id(self.response_id)

    @property
    def num_top(self) -> int:
        return self.req.top_logprobs or 0

    @property
    def parses_calls(self) -> bool:
        return self.tool_call_parser is not None or self.forced is not None

    def parsed(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A reply's text -> (content, calls): forced calls, or those the tool call parser finds."""
        if self.forced is not None:
            return self.forced.parse(text)
        return parse_tool_calls(self.tool_call_parser, text)

    def call_stream(self) -> ToolCallStream | NamedCallStream | RequiredCallStream:
        return self.forced.stream() if self.forced is not None else ToolCallStream(self.tool_call_parser)

    def finish_with_calls(self, reason: str | None) -> str | None:
        """A reply with tool calls that ended on a stop ends with "tool_calls" (OpenAI's), but a named
        function's ("stop"); a cut one keeps its reason ("length", "abort")."""
        if reason != "stop":
            return reason
        return self.forced.finish_reason if self.forced is not None else "tool_calls"

    def allowed_calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        """parallel_tool_calls false: at most one call (the first), as OpenAI's contract says."""
        return calls[:1] if self.req.parallel_tool_calls is False else calls

    def ids(self, token_ids: list[int]) -> list[int] | None:
        return token_ids if self.req.return_token_ids else None

    def chunk(self, choices: list[ChatChunkChoice], usage_=None, first: bool = False) -> ChatCompletionChunk:
        prompt_ids = self.prompt if first and self.req.return_token_ids else None
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.engine.model_name,
                                   choices=choices, usage=usage_, prompt_token_ids=prompt_ids)

    @cached_property
    def running_usage(self) -> RunningUsage | None:
        """The usage so far that every streamed chunk carries (continuous usage); None: they carry none."""
        return RunningUsage(len(self.prompt)) if self.req.continuous_usage else None

    @cached_property
    def frame(self) -> ChunkFrame | UsageChunkFrame:
        return chunk_frame(self.response_id, "chat.completion.chunk", self.created, self.engine.model_name,
                           self.req.include_usage, self.running_usage)

    def delta_event(self, d: ChoiceDelta) -> str:
        """The SSE event of one streamed delta: the bytes of frame.event(chunk([ChatChunkChoice(...)])),
        built without pydantic when no logprobs are asked for (the per-token hot path)."""
        if self.req.logprobs:
            logprobs = chat_logprobs(d.logprobs or [], self.num_top, self.engine.tokenizer)
            choice = ChatChunkChoice(index=d.index, delta=ChatDelta(content=d.text), logprobs=logprobs,
                                     finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                                     token_ids=self.ids(d.token_ids))
            return self.frame.event(self.chunk([choice]))
        if d.finish_reason is None and d.stop_reason is None and not self.req.return_token_ids:
            return (f'{self.frame.head}{{"index":{d.index},"delta":{{"content":{json_str(d.text)}}},'
                    f'"logprobs":null,"finish_reason":null}}{self.frame.tail}')
        parts = [self.frame.head, '{"index":', str(d.index), ',"delta":{"content":', json_text(d.text),
                 '},"logprobs":null', json_member("finish_reason", d.finish_reason)]
        if d.stop_reason is not None:
            parts.append(json_member("stop_reason", d.stop_reason))
        if self.req.return_token_ids:
            parts.append(json_member("token_ids", d.token_ids))
        parts.append("}" + self.frame.tail)
        return "".join(parts)


EXAMPLE = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}  # the schema's example body


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest, EXAMPLE))
async def create_chat_completion(request: Request) -> Response:
    engine = request.app.state.engine
    req = await parse_body(request, ChatCompletionRequest)
    check_model(engine, req.model)
    request_id = resolve_request_id(request, req.request_id)
    grammar = await request_grammar(request, req, engine.tokenizer)
    job = await run_request_work(request, _job, engine, req, request.app.state.limits,
                                request.app.state.tool_call_parser, grammar, request_id)
    job.reservation = admit(request, [job.prompt], job.params,
                            "top_logprobs" if req.top_logprobs else "logprobs",
                            tokens_field({"max_completion_tokens": req.max_completion_tokens,
                                          "max_tokens": req.max_tokens}, req.n, "messages"))
    return await job_response(request, req.stream, lambda: _stream(job), lambda: _complete(job),
                              job.reservation)


def _job(engine, req: ChatCompletionRequest, limits: RequestLimits | None = None,
         tool_call_parser: str | None = None, grammar: Grammar | None = None,
         request_id: str | None = None) -> ChatJob:
    """`request_id`: the one resolve_request_id gave; None: a fresh one."""
    if req.top_logprobs and not req.logprobs:  # 0 asks for nothing (vLLM's default)
        raise APIError(400, "top_logprobs requires logprobs to be true.", "top_logprobs")
    if req.calls_tools and tool_call_parser is None:
        raise APIError(400, '"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                            'and --tool-call-parser; tool_choice "none" shows the tools without calls.',
                       "tool_choice")
    if (req.calls_tools or forced_calls(req) is not None) and not req.detokenizes:
        raise APIError(400, "tool calls are read from the reply's text, which detokenize false leaves out; "
                            'tool_choice "none" shows the tools without calls.', "tool_choice")
    prompt = chat_prompt_ids(engine.tokenizer, req.messages, req.add_generation_prompt,
                             req.add_special_tokens, template_variables(req.chat_template_kwargs, req.tools))
    if not prompt:  # a template that renders these messages to nothing: nothing for the model to read
        raise APIError(400, "The chat template renders these messages to no token; the prompt must not be "
                            "empty.", "messages")
    (prompt,), cut_to = truncated([prompt], req.truncate_prompt_tokens, engine.max_model_len)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = _room_left(engine, len(prompt), req.n or 1, limits or RequestLimits(),
                                (req.top_logprobs or 0) if req.logprobs else None, req.prompt_logprobs)
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_cut_room(cut_to, max_tokens, engine.max_model_len, limit_param)
    check_context_length(engine, [prompt], max_tokens, "messages", limit_param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs, engine.tokenizer, engine.sampling_defaults, grammar)
    if req.calls_tools and tool_call_parser == "hermes" and req.skip_special_tokens is None:
        params.skip_special_tokens = False  # models that make <tool_call> a special token keep it (vLLM's)
    response_id = f"chatcmpl-{request_id or new_request_id()}"
    return ChatJob(engine, req, response_id, int(time.time()), prompt, params,
                   tool_call_parser=tool_call_parser if req.calls_tools else None, forced=forced_calls(req))


def _room_left(engine, num_prompt_tokens: int, n: int, limits: RequestLimits, logprobs: int | None,
               prompt_logprobs: int | None = None) -> int:
    """OpenAI's default max_tokens: as much as the context, the KV cache and the request limits (total
    tokens, logprob entries beside the prompt's; for n choices) leave."""
    kv = engine.health()["kv_cache"]
    kv_tokens = (kv["free_blocks"] + kv["used_blocks"]) * kv["block_size"]
    room = min(engine.max_model_len, kv_tokens // n, limits.max_request_tokens // n) - num_prompt_tokens
    if logprobs is not None:
        entries = limits.max_logprob_entries
        if prompt_logprobs is not None:
            entries -= n * num_prompt_tokens * (1 + prompt_logprobs)
        room = min(room, entries // (n * (1 + logprobs)))
    return max(1, room)


async def _complete(job: ChatJob) -> bytes:
    states = [ChoiceState() for _ in range(job.params.n)]
    await collect_choices(job.engine, job.engine_id, job.response_id, [job.prompt], job.params, states,
                          job.reservation)
    return await build_response(_response_body, job, states,
                                heavy=bool(job.req.logprobs) or job.req.prompt_logprobs is not None)


def _response_body(job: ChatJob, states: list[ChoiceState]) -> bytes:
    tok = job.engine.tokenizer
    choices = [
        ChatChoice(index=i, message=_message(job, st.text),
                   logprobs=chat_logprobs(st.logprobs, job.num_top, tok) if job.req.logprobs else None,
                   finish_reason=st.finish_reason, stop_reason=st.stop_reason,
                   token_ids=job.ids(st.token_ids))
        for i, st in enumerate(states)
    ]
    for choice in choices:
        if choice.message.tool_calls:
            choice.finish_reason = job.finish_with_calls(choice.finish_reason)
    prompt_lps = None
    if job.req.prompt_logprobs is not None and states[0].prompt_logprobs is not None:
        prompt_lps = vllm_prompt_logprobs(decoded_tokens(tok, job.req), job.prompt, states[0].prompt_logprobs,
                                          job.req.prompt_logprobs)
    resp = ChatCompletionResponse(id=job.response_id, created=job.created, model=job.engine.model_name,
                                  choices=choices, usage=usage([job.prompt], states),
                                  prompt_token_ids=job.prompt if job.req.return_token_ids else None,
                                  prompt_logprobs=prompt_lps)
    return resp.model_dump_json().encode()


def _message(job: ChatJob, text: str) -> ChatResponseMessage:
    """A choice's reply: its text, or with tool calls parsed from it, the text before them and the calls."""
    if not job.parses_calls:
        return ChatResponseMessage(content=text)
    content, calls = job.parsed(text)
    calls = job.allowed_calls(calls)
    return ChatResponseMessage(content=content, tool_calls=[_call_out(c) for c in calls] or None)


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=ToolCallFunction(name=call.name, arguments=call.arguments))


def _tool_delta_events(job: ChatJob, tools: ToolCallStream | NamedCallStream | RequiredCallStream,
                       d: ChoiceDelta) -> list[str]:
    """A delta of a choice whose reply may hold tool calls: a forced reply's as its calls' pieces; an "auto"
    one's text less what the stream holds, at the choice's end the held text, then the calls in one delta
    (finish_with_calls' reason)."""
    if not isinstance(tools, ToolCallStream):
        return _forced_call_events(job, tools, d)
    d.text = tools.feed(d.text)
    if d.finish_reason is None:  # while a call is written the stream holds its text: no empty deltas then,
        # unless the request asked for each token's ids or logprobs
        said_per_token = d.token_ids and (job.req.return_token_ids or job.req.logprobs)
        return [job.delta_event(d)] if d.text or said_per_token else []
    held, calls = tools.finish()
    calls = job.allowed_calls(calls)
    d.text += held
    if not calls:
        return [job.delta_event(d)]
    reason = job.finish_with_calls(d.finish_reason)
    deltas = [DeltaToolCall(index=i, **_call_out(c).model_dump()) for i, c in enumerate(calls)]
    last = ChatChunkChoice(index=d.index, delta=ChatDelta(tool_calls=deltas), finish_reason=reason,
                           stop_reason=d.stop_reason)
    events = [job.frame.event(job.chunk([last]))]
    if d.text or (d.token_ids and (job.req.return_token_ids or job.req.logprobs)):  # the content before the
        # calls, and the last ids where asked for, in a delta of their own
        events.insert(0, job.delta_event(replace(d, finish_reason=None, stop_reason=None)))
    return events


def _forced_call_events(job: ChatJob, calls: NamedCallStream | RequiredCallStream, d: ChoiceDelta
                        ) -> list[str]:
    """A delta of a forced reply: the calls' pieces its text gives (a call's first with its id and name), and
    as content the text that leaves the calls' shape; the last one also what the reply's end leaves, with
    finish_with_calls' reason once a call has gone out (and a "required" array has closed)."""
    content, deltas = calls.feed(d.text)
    if d.finish_reason is not None:
        rest, more = calls.finish()
        content, deltas = content + rest, deltas + more
    said_per_token = job.req.return_token_ids or job.req.logprobs
    if not content and not deltas and d.finish_reason is None and not said_per_token:
        return []  # ids that give nothing yet (part of a character, the array's own tokens)
    logprobs = None
    if job.req.logprobs:
        logprobs = chat_logprobs(d.logprobs or [], job.num_top, job.engine.tokenizer)
    reason = job.finish_with_calls(d.finish_reason) if calls.started and calls.complete else d.finish_reason
    delta = ChatDelta(content=content or None, tool_calls=deltas or None)
    choice = ChatChunkChoice(index=d.index, delta=delta, logprobs=logprobs, finish_reason=reason,
                             stop_reason=d.stop_reason, token_ids=job.ids(d.token_ids))
    return [job.frame.event(job.chunk([choice]))]


async def _stream(job: ChatJob) -> AsyncIterator[str]:
    states = streamed_choices([0] * job.params.n, job.running_usage)
    tools = [job.call_stream() for _ in states] if job.parses_calls else None
    for i in range(job.params.n):
        role = ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
        yield job.frame.event(job.chunk([role], first=(i == 0)))
    async with aclosing(merged_outputs(job.engine, job.engine_id, job.response_id, [job.prompt], job.params,
                                       job.reservation)) as outs:
        async for _, out in outs:
            if out.error:
                raise engine_error(out)
            for d in out.deltas:
                states[d.index].add(d)
                if tools is not None:
                    for event in _tool_delta_events(job, tools[d.index], d):
                        yield event
                elif d.text or d.token_ids or d.finish_reason:
                    yield job.delta_event(d)
    if job.req.include_usage:
        yield sse_event(job.chunk([], usage([job.prompt], states)))
