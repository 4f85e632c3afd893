"""Request prompts -> token ids, with a 400 naming the field for everything the client got wrong."""

from __future__ import annotations

from server.api.errors import APIError
from server.api.protocol import ChatMessage
from server.model.chat_template import ChatTemplateError
from server.model.tokenizer import NoChatTemplateError


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the template sees them: role and one content string."""
    out = []
    for i, m in enumerate(messages):
        try:
            out.append({"role": m.role, "content": m.text()})
        except ValueError as e:
            raise APIError(400, str(e), f"messages[{i}].content") from None
    return out


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    """Rendered by the model's chat template and tokenized as transformers' apply_chat_template does."""
    try:
        return tokenizer.chat_token_ids(chat_messages(messages), add_generation_prompt)
    except NoChatTemplateError as e:
        raise APIError(400, f"Chat is not available: {e}.", "messages", "chat_template_missing") from None
    except ChatTemplateError as e:  # templates may reject role orders etc.
        raise APIError(400, f"The chat template rejected these messages: {e}", "messages") from None
