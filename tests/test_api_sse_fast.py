"""The hand-built SSE chunks of the streaming hot path are byte-identical to the pydantic models' output."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.api.chat import ChatJob
from server.api.completions import CompletionJob
from server.api.logprobs import chat_logprobs
from server.api.outputs import ChoiceDelta, TokenLogprob
from server.api.protocol import ChatChunkChoice, ChatCompletionRequest, ChatDelta, CompletionRequest
from server.api.streaming import chunk_event, sse_event
from server.engine.sampling_params import SamplingParams
from server.model.tokenizer import ByteTokenizer

ENGINE = SimpleNamespace(model_name='tiny "model" é', tokenizer=ByteTokenizer())
PROMPTS = [[1, 72, 105], [1, 33]]

DELTAS = [
    ChoiceDelta(0, "Hello", [75], None),
    ChoiceDelta(1, "", [260], None),
    ChoiceDelta(0, 'quote " back \\ slash\nnew\tline \x01 ctrl', [3, 4], None),
    ChoiceDelta(1, "héllo wörld ✓ 𝄞 \u2028 \ufffd", [200, 201], None),
    ChoiceDelta(0, "end", [5], None, "stop", "STOP"),
    ChoiceDelta(1, "", [2], None, "stop", 2),
    ChoiceDelta(0, "x", [6], None, "length", None),
    ChoiceDelta(1, "", [], None, "abort", None),
]


def usage_options(include_usage: bool) -> dict:
    return {"stream_options": {"include_usage": True}} if include_usage else {}


def completion_job(return_token_ids: bool, n: int = 2, include_usage: bool = False) -> CompletionJob:
    req = CompletionRequest(prompt=PROMPTS, stream=True, return_token_ids=return_token_ids,
                            **usage_options(include_usage))
    params = SamplingParams(n=n)
    return CompletionJob(ENGINE, req, "cmpl-abc123", 1_700_000_000, PROMPTS, ["", ""], params)


def chat_job(return_token_ids: bool, include_usage: bool = False) -> ChatJob:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True,
                                return_token_ids=return_token_ids, **usage_options(include_usage))
    return ChatJob(ENGINE, req, "chatcmpl-xyz", 1_700_000_001, PROMPTS[0], SamplingParams())


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("with_prompt_ids", [False, True])
@pytest.mark.parametrize("choice_index", [0, 3])
@pytest.mark.parametrize("delta", DELTAS, ids=range(len(DELTAS)))
def test_completion_delta_event_matches_pydantic(delta, choice_index, with_prompt_ids, return_token_ids,
                                                 include_usage):
    job = completion_job(return_token_ids, include_usage=include_usage)
    choice = job.choice(choice_index, delta.text, delta, 0, delta.token_ids, with_prompt_ids)
    expected = chunk_event(job.response([choice]), include_usage)
    assert job.delta_event(choice_index, delta, 0, with_prompt_ids) == expected


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("delta", DELTAS, ids=range(len(DELTAS)))
def test_chat_delta_event_matches_pydantic(delta, return_token_ids, include_usage):
    job = chat_job(return_token_ids, include_usage)
    choice = ChatChunkChoice(index=delta.index, delta=ChatDelta(content=delta.text), logprobs=None,
                             finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                             token_ids=job.ids(delta.token_ids))
    assert job.delta_event(delta) == chunk_event(job.chunk([choice]), include_usage)


CONTINUOUS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("with_prompt_ids", [False, True])
@pytest.mark.parametrize("delta", DELTAS, ids=range(len(DELTAS)))
def test_continuous_usage_chunks_match_pydantic(delta, with_prompt_ids, return_token_ids):
    """continuous_usage_stats: the hand-built tail writes the usage so far as the pydantic chunk does."""
    req = CompletionRequest(prompt=PROMPTS, stream=True, return_token_ids=return_token_ids, **CONTINUOUS)
    job = CompletionJob(ENGINE, req, "cmpl-abc123", 1, PROMPTS, ["", ""], SamplingParams(n=2))
    job.running_usage.completion_tokens = 11
    choice = job.choice(3, delta.text, delta, 0, delta.token_ids, with_prompt_ids)
    expected = sse_event(job.response([choice], job.running_usage.usage()))
    assert '"usage":{"prompt_tokens":5,"completion_tokens":11,"total_tokens":16}' in expected
    assert job.delta_event(3, delta, 0, with_prompt_ids) == expected

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True,
                                return_token_ids=return_token_ids, **CONTINUOUS)
    chat = ChatJob(ENGINE, req, "chatcmpl-xyz", 1, PROMPTS[0], SamplingParams())
    chat.running_usage.completion_tokens = 2
    choice = ChatChunkChoice(index=delta.index, delta=ChatDelta(content=delta.text), logprobs=None,
                             finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                             token_ids=chat.ids(delta.token_ids))
    expected = sse_event(chat.chunk([choice], chat.running_usage.usage()))
    assert chat.delta_event(delta) == expected and chat.frame.event(chat.chunk([choice])) == expected


def test_continuous_usage_goes_before_the_first_chunks_prompt_ids():
    """The usage of the first chat chunk comes where the chunk model puts it: before prompt_token_ids."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True,
                                return_token_ids=True, **CONTINUOUS)
    chat = ChatJob(ENGINE, req, "chatcmpl-xyz", 1, PROMPTS[0], SamplingParams())
    role = ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))
    event = chat.frame.event(chat.chunk([role], first=True))
    usage = '"usage":{"prompt_tokens":3,"completion_tokens":0,"total_tokens":3}'
    assert event.endswith(f'{usage},"prompt_token_ids":[1,72,105]}}\n\n')


def test_chunks_carry_usage_null_only_where_usage_is_asked_for():
    """OpenAI: with include_usage every chunk but the last carries "usage": null; without, none has it."""
    delta = DELTAS[0]
    for include_usage in (False, True):
        event = chat_job(False, include_usage).delta_event(delta)
        assert (',"usage":null}' in event) == include_usage
        event = completion_job(False, include_usage=include_usage).delta_event(0, delta, 0, False)
        assert (',"usage":null}' in event) == include_usage
    assert sse_event(chat_job(False).chunk([])) == chunk_event(chat_job(False).chunk([]), False)


def test_logprob_chunks_keep_the_pydantic_path():
    lp = TokenLogprob(75, "H", -0.25, [(75, "H", -0.25), (76, "I", -1.5)])
    delta = ChoiceDelta(0, "H", [75], [lp])
    req = CompletionRequest(prompt=PROMPTS[0], stream=True, logprobs=2)
    job = CompletionJob(ENGINE, req, "cmpl-lp", 1, [PROMPTS[0]], [""], SamplingParams(logprobs=2))
    event = job.delta_event(0, delta, 7, True)
    assert '"text_offset":[7]' in event and '"top_logprobs":[{"H":-0.25,"I":-1.5}]' in event

    chat = ChatJob(ENGINE, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                                 top_logprobs=1), "chatcmpl-lp", 1, PROMPTS[0],
                   SamplingParams(logprobs=1))
    logprobs = chat_logprobs([lp], 1, ENGINE.tokenizer)
    choice = ChatChunkChoice(index=0, delta=ChatDelta(content="H"), logprobs=logprobs)
    assert chat.delta_event(delta) == sse_event(chat.chunk([choice]))
