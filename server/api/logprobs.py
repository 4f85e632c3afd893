"""Engine TokenLogprobs -> the two OpenAI logprob shapes (completions and chat), and the prompt's entries
-> echo logprobs (OpenAI) or prompt_logprobs (vLLM)."""

from __future__ import annotations

from collections.abc import Callable

from server.api.outputs import TokenLogprob, reported_logprob, token_id_string
from server.api.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob


def completion_logprobs(tokens: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """`text_offset` is the length of the choice's text before the first of these tokens."""
    out = CompletionLogprobs()
    for lp in tokens:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        # the sampled token is always among them, as OpenAI's "up to logprobs + 1" entries (vLLM's too)
        out.top_logprobs.append({**{tok: logprob for _, tok, logprob in lp.top}, lp.token: lp.logprob})
        out.text_offset.append(text_offset)
        text_offset += len(lp.token)
    return out


def echo_logprobs(token_string: Callable[[int], str], prompt_ids: list[int], entries: list, k: int
                  ) -> CompletionLogprobs:
    """The prompt's part of `echo` with `logprobs` k: one entry per prompt token from the core's prompt
    logprobs, the first without a logprob (nothing precedes it). A position's top_logprobs holds the prompt
    token itself besides the top-k, as OpenAI's and vLLM's do. `token_string`: a token id -> its entry's
    string (its text, or token_id_string's)."""
    out = CompletionLogprobs()
    offset = 0
    for token, entry in zip(prompt_ids, entries, strict=True):
        text = token_string(token)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        logprob, top = reported_logprob(entry[0]), entry[2][:k]  # (logprob, rank, top), top at least k
        out.token_logprobs.append(logprob)
        top_of = {token_string(t): reported_logprob(lp) for t, lp in top}
        out.top_logprobs.append({**top_of, text: logprob})
    return out


def decoded_tokens(tokenizer, req) -> Callable[[int], str | None]:
    """A prompt logprob entry's decoded_token: the token's text; its id's string (return_tokens_as_token_ids);
    None where the request asks for no text (detokenize false: no text is read, as vLLM gives it)."""
    if req.return_tokens_as_token_ids:
        return token_id_string
    return tokenizer.token_text if req.detokenizes else _no_text


def _no_text(_token_id: int) -> None:
    return None


def vllm_prompt_logprobs(decoded: Callable[[int], str | None], prompt_ids: list[int], entries: list, k: int
                         ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: per prompt token (None for the first) its own entry and its top-k, keyed by
    token id, each with its logprob, vocabulary rank and `decoded` token (decoded_tokens)."""
    out: list[dict[str, PromptLogprob] | None] = []
    for token, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        logprob, rank, top = entry
        # the prompt token first, then the top k (one of them may be the prompt token: it keeps its place
        # and takes the top list's rank, as vLLM's dict does)
        position = {str(token): PromptLogprob(logprob=reported_logprob(logprob), rank=rank,
                                              decoded_token=decoded(token))}
        for r, (t, lp) in enumerate(top[:k], start=1):
            position[str(t)] = PromptLogprob(logprob=reported_logprob(lp), rank=r,
                                             decoded_token=decoded(t))
        out.append(position)
    return out


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=first.tokens + then.tokens,
                              token_logprobs=first.token_logprobs + then.token_logprobs,
                              top_logprobs=first.top_logprobs + then.top_logprobs,
                              text_offset=first.text_offset + then.text_offset)


def chat_logprobs(tokens: list[TokenLogprob], num_top: int, tokenizer) -> ChatLogprobs:
    """`bytes` are each token's own (tokenizer.bytes_of): a token holding part of a character gives its
    bytes, which a client joins with its neighbours', where its text reads U+FFFD; with
    return_tokens_as_token_ids too, where `token` is its id's string."""
    bytes_of = tokenizer.bytes_of
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=lp.token, logprob=lp.logprob, bytes=list(bytes_of(lp.token_id)),
                         top_logprobs=[TopLogprob(token=tok, logprob=logprob, bytes=list(bytes_of(t)))
                                       for t, tok, logprob in lp.top[:num_top]])
        for lp in tokens
    ])
