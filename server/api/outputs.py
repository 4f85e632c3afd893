"""What a request's stream yields on the API side: one RequestOutput per engine step that touched it."""

from __future__ import annotations

from dataclasses import dataclass, field

# the floor of a reported logprob: a token the model masks (-inf) reads -9999.0, as vLLM reports it, where
# JSON has no -inf (pydantic would write null, json.dumps -Infinity)
MIN_LOGPROB = -9999.0


def reported_logprob(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


def token_id_string(token_id: int) -> str:
    """A logprob entry's token with return_tokens_as_token_ids, as vLLM spells it: its id, no text read."""
    return f"token_id:{token_id}"


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # its text alone, or token_id_string's (return_tokens_as_token_ids)
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token_id, token, logprob), best first


@dataclass
class ChoiceDelta:
    index: int  # choice index in [0, n)
    text: str  # new text since the previous delta of this choice; stop strings are never in it
    token_ids: list[int]  # new token ids since the previous delta
    logprobs: list[TokenLogprob] | None  # one per new token when logprobs were asked for
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string / stop token id that ended the choice
    # the core's (logprob, [(token id, logprob)]) per prompt token (None first), on a choice's first delta
    # when prompt logprobs were asked for
    prompt_logprobs: list | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    deltas: list[ChoiceDelta]
    finished: bool  # every choice has a finish_reason
    error: str | None = None
    error_kind: str | None = None  # SeqUpdate.error_kind: STRUCTURED_OUTPUT_FAILED, the request's own; None


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: each choice's deltas concatenated in order. A reader
    that fell behind (the event loop busier than the engine's step rate) catches up in one SSE event per
    choice instead of one per step."""
    if len(outs) == 1:
        return outs[0]
    merged = MergedOutput(outs[0])
    for out in outs[1:]:
        merged.add(out)
    return merged.out


class MergedOutput:
    """merge_outputs one output at a time: `out` is the merge of every output added so far (its deltas are
    copies; the inputs are never changed)."""

    __slots__ = ("out", "by_index")

    def __init__(self, first: RequestOutput):
        self.out = RequestOutput(first.request_id, first.prompt_token_ids, [], first.finished, None)
        self.by_index: dict[int, ChoiceDelta] = {}
        self.add(first)

    def add(self, out: RequestOutput) -> None:
        merged, by_index = self.out, self.by_index
        for d in out.deltas:
            m = by_index.get(d.index)
            if m is None:
                m = by_index[d.index] = ChoiceDelta(d.index, d.text, list(d.token_ids),
                                                    None if d.logprobs is None else list(d.logprobs),
                                                    d.finish_reason, d.stop_reason, d.prompt_logprobs)
                merged.deltas.append(m)
                continue
            m.text += d.text
            m.token_ids += d.token_ids
            if d.logprobs is not None:
                m.logprobs = (m.logprobs or []) + d.logprobs
            m.finish_reason, m.stop_reason = d.finish_reason, d.stop_reason
        merged.request_id, merged.prompt_token_ids, merged.finished = (out.request_id, out.prompt_token_ids,
                                                                       out.finished)
        if not merged.error and out.error:  # the first error
            merged.error, merged.error_kind = out.error, out.error_kind
