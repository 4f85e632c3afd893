"""Engine TokenLogprobs -> the two OpenAI logprob shapes (completions and chat)."""

from __future__ import annotations

from server.api.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from server.api.outputs import TokenLogprob


def completion_logprobs(tokens: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """`text_offset` is the length of the choice's text before the first of these tokens."""
    out = CompletionLogprobs()
    for lp in tokens:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({tok: logprob for _, tok, logprob in lp.top})
        out.text_offset.append(text_offset)
        text_offset += len(lp.token)
    return out


def chat_logprobs(tokens: list[TokenLogprob], num_top: int) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=lp.token, logprob=lp.logprob, bytes=_bytes(lp.token),
                         top_logprobs=[TopLogprob(token=tok, logprob=logprob, bytes=_bytes(tok))
                                       for _, tok, logprob in lp.top[:num_top]])
        for lp in tokens
    ])


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
