"""Request prompts -> token ids, with a 400 naming the field for everything the client got wrong."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from server.api.errors import APIError
from server.api.protocol import ChatMessage, ToolCallArgumentsError
from server.model.chat_template import ChatTemplateError
from server.model.tokenizer import NoChatTemplateError


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the template sees them: role, one content string, name / tool fields when set."""
    out = []
    for i, m in enumerate(messages):
        try:
            out.append(m.for_template())
        except ToolCallArgumentsError as e:
            raise APIError(400, str(e), f"messages[{i}].tool_calls") from None
        except ValueError as e:
            raise APIError(400, str(e), f"messages[{i}].content") from None
    return out


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    add_special_tokens: bool | None = None, template_kwargs: dict | None = None) -> list[int]:
    """Rendered by the model's chat template. `add_special_tokens` None: tokenized as transformers'
    apply_chat_template does (the template spells its own BOS); True/False: with/without the
    post-processor."""
    plain, variables = chat_messages(messages), template_kwargs or {}
    with template_errors():
        if add_special_tokens is None:
            return tokenizer.chat_token_ids(plain, add_generation_prompt, variables)
        text = tokenizer.apply_chat_template(plain, add_generation_prompt, variables)
    return tokenizer.encode(text, add_bos=add_special_tokens)


def truncated(prompts: list[list[int]], keep: int | None, max_model_len: int
              ) -> tuple[list[list[int]], int | None]:
    """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: max_model_len of them); None
    leaves them whole. -> (the prompts, `keep` where some prompt was cut, else None). More than
    max_model_len is a 400, as vLLM's."""
    if keep is None:
        return prompts, None
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be at least 1 (or -1: the model's maximum context "
                            "length); 0 leaves no prompt.", "truncate_prompt_tokens")
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens ({keep}) must be at most the model's maximum context "
                            f"length ({max_model_len}), or -1 for it.", "truncate_prompt_tokens")
    cut = any(len(p) > keep for p in prompts)
    return [p[-keep:] if len(p) > keep else p for p in prompts], keep if cut else None


def check_cut_room(cut_to: int | None, max_tokens: int, limit: int, max_tokens_param: str) -> None:
    """A prompt cut to `cut_to` tokens that leaves no room for the completion: the cut is what to change
    (context_length_exceeded naming truncate_prompt_tokens, not the prompt the client sent)."""
    if cut_to is not None and cut_to + max_tokens > limit:
        raise APIError(400, f"truncate_prompt_tokens keeps {cut_to} prompt tokens, and with {max_tokens} "
                            f"for the completion ({max_tokens_param}) that exceeds this model's maximum "
                            f"context length of {limit} tokens; keep at most {limit - max_tokens}.",
                       "truncate_prompt_tokens", "context_length_exceeded")


def template_variables(kwargs: dict | None, tools: list | None) -> dict:
    """chat_template_kwargs, and the request's tools as transformers passes them to a template."""
    variables = dict(kwargs or {})
    if tools:
        variables["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
    return variables


@contextmanager
def template_errors() -> Iterator[None]:
    try:
        yield
    except NoChatTemplateError as e:
        raise APIError(400, f"Chat is not available: {e}.", "messages", "chat_template_missing") from None
    except ChatTemplateError as e:  # templates may reject role orders etc.
        raise APIError(400, f"The chat template rejected these messages: {e}", "messages") from None


def check_context_length(engine, prompts: list[list[int]], max_tokens: int, prompt_param: str,
                         max_tokens_param: str = "max_tokens") -> None:
    """OpenAI's context_length_exceeded: blames the prompt when it leaves no room for one token (max_tokens
    0, scoring the prompt: when it is longer than the context), else the requested completion length."""
    limit = engine.max_model_len
    longest = max(len(ids) for ids in prompts)
    if longest > limit or (longest == limit and max_tokens > 0):
        raise APIError(400, f"This model's maximum context length is {limit} tokens, but the {prompt_param} "
                            f"has {longest} tokens, which leaves no room for a completion; shorten the "
                            f"{prompt_param}.", prompt_param, "context_length_exceeded")
    if longest + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens, but "
                            f"{longest + max_tokens} were requested ({longest} in the {prompt_param}, "
                            f"{max_tokens} for the completion); reduce {max_tokens_param} to at most "
                            f"{limit - longest}.", max_tokens_param, "context_length_exceeded")
