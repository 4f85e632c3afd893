"""loadtest.sse.StreamReader: SSE bytes split anywhere give the same chunk times and counts."""

import json

import pytest

from loadtest.sse import StreamReader


def event(payload) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def completion(text, ids=None):
    choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


BODY = b"".join([
    b": a comment line\n\n",
    event(completion("a", [97])),
    event(completion("", [200])),  # an id without printable text yet still counts
    event({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "b"}}]}),
    event(completion("", None)),  # no text, no ids: not a content chunk
    event(completion("cd", [99, 100])),
    event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}),
    b"data: [DONE]\n\n",
])  # fmt: skip


def read(pieces: list[bytes]) -> StreamReader:
    reader = StreamReader([])
    for t, piece in enumerate(pieces):
        assert reader.feed(piece, float(t))
    assert reader.close(float(len(pieces)))
    return reader


@pytest.mark.parametrize("size", [1, 3, 17, len(BODY)])
def test_split_reads_give_the_same_result(size):
    reader = read([BODY[i : i + size] for i in range(0, len(BODY), size)])
    assert (reader.done, reader.failure, reader.streamed_ids) == (True, None, 4)
    assert (reader.completion_tokens, reader.prompt_tokens) == (5, 7)
    assert len(reader.chunk_times) == 4
    assert reader.chunk_times == sorted(reader.chunk_times)


def test_one_read_stamps_its_events_with_its_time():
    reader = read([BODY])
    assert reader.chunk_times == [0.0] * 4


def test_crlf_lines_and_a_last_line_without_newline():
    body = BODY.replace(b"\n", b"\r\n").removesuffix(b"\r\n\r\n")
    reader = read([body])
    assert reader.done and reader.streamed_ids == 4


@pytest.mark.parametrize("bad, kind", [
    (b"{not json", "bad_response"),
    (b'"a string"', "bad_response"),
    (b'{"choices": [{"token_ids": "x"}]}', "bad_response"),
    (json.dumps({"error": {"message": "boom", "type": "server_error"}}).encode(), "stream_error"),
])  # fmt: skip
def test_a_bad_or_error_event_stops_the_reading(bad, kind):
    reader = StreamReader([])
    assert reader.feed(event(completion("a", [97])), 0.0)
    assert not reader.feed(event(bad) + event(completion("b", [98])), 1.0)
    assert reader.failure[0] == kind and reader.chunk_times == [0.0]
    if kind == "stream_error":
        assert json.loads(reader.failure[1]) == {"message": "boom", "type": "server_error"}


def test_an_error_field_of_null_is_no_error():
    # a server may send "error": null in every chunk: that is an ordinary content chunk
    reader = StreamReader([])
    assert reader.feed(event({**completion("a", [97]), "error": None}), 1.0)
    assert reader.failure is None and reader.chunk_times == [1.0]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_a_reasoning_delta_is_a_content_chunk(field):
    """A reasoning model's first tokens are its thinking (`delta.reasoning_content`, vLLM's newer
    `delta.reasoning`): they are tokens, so they stamp the TTFT and the gaps, as vLLM's bench counts them."""
    chat = lambda delta: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    reader = read([event(chat({"role": "assistant", "content": ""})), event(chat({field: "hm"})),
                   event(chat({field: "m"})), event(chat({"content": "ok"})), b"data: [DONE]\n\n"])
    assert reader.chunk_times == [1.0, 2.0, 3.0]


SPEC_BODY = b"".join([
    b"\xef\xbb\xbf",  # a byte-order mark first: dropped (the spec), not a prefix hiding the first event
    b"data:\n\n",  # an empty data field (a keep-alive): no event
    b"event: message\nid: 1\n",  # other fields: skipped
    b'data: {"choices": [{"index": 0,\ndata:  "text": "a", "token_ids": [97]}]}\n\n',  # one event, two lines
    event(completion("cd", [99, 100])),
    event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}),
    b"data: [DONE]\n\n",
])  # fmt: skip


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
@pytest.mark.parametrize("size", [1, 2, 5, 10_000])
def test_event_stream_framing_as_the_spec_reads_it(ending, size):
    """A review: LF, CRLF or a lone CR end a line (a CRLF split between reads is one ending); an event's data
    lines join with LF; a leading byte-order mark and an empty data field hide no event."""
    body = SPEC_BODY.replace(b"\n", ending)
    reader = read([body[i : i + size] for i in range(0, len(body), size)])
    assert (reader.done, reader.failure, reader.streamed_ids, reader.completion_tokens) == (True, None, 3, 3)
    assert len(reader.chunk_times) == 2


def test_events_without_the_blank_lines_between_them_still_count():
    # a server writing one `data:` line per event and no blank line: the joined lines are no JSON, each is
    body = b"".join(event(completion(t, [ord(t)])).removesuffix(b"\n") for t in "abc") + b"data: [DONE]\n"
    reader = read([body])
    assert (reader.done, reader.failure, reader.streamed_ids) == (True, None, 3)
