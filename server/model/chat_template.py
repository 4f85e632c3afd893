"""Chat templates: jinja2 compiled once at start-up, rendered the way transformers renders them.

transformers' environment is sandboxed (ImmutableSandboxedEnvironment), trims blocks, and adds what Hub
templates rely on: `{% break %}`/`{% continue %}` (jinja2's loopcontrols), `{% generation %}` (marks the
assistant's part for training masks; rendering emits its body), a `tojson` that keeps non-ASCII text and takes
json.dumps' indent/separators/sort_keys, `raise_exception(message)` and `strftime_now(format)`.
"""

from __future__ import annotations

import contextvars
import json
import re
import threading
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range


class ChatTemplateError(ValueError):
    """The template itself refused to render (raise_exception, a jinja error): the messages' fault."""


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# range() elements one render may make in all: the sandbox bounds each range at 100,000 but not a loop in a
# loop (two nested ranges held the API's event loop for good: a review); a Hub template's loops run over the
# messages and the tools, not over ranges of this size
MAX_RANGE_ELEMENTS = 1_000_000
_range_left: contextvars.ContextVar[int] = contextvars.ContextVar("range_left", default=MAX_RANGE_ELEMENTS)


def _bounded_range(*args) -> range:
    r = safe_range(*args)
    left = _range_left.get() - len(r)
    if left < 0:
        raise ChatTemplateError(f"the chat template asked for over {MAX_RANGE_ELEMENTS} range() elements")
    _range_left.set(left)
    return r


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    return env


_ENV = _environment()
RENDER_CHECK_S = 5.0  # a two-message conversation renders in about a millisecond


class ChatTemplate:
    """A compiled template; a syntax error is a ValueError here, at start-up, not on every request."""

    def __init__(self, source: str, origin: str, tool_use: ChatTemplate | None = None) -> None:
        self.source = source
        self.origin = origin  # where it came from, for error messages
        self.tool_use = tool_use  # the checkpoint's "tool_use" template: it renders requests with tools
        # a template that names the "developer" role renders it its own way; the others get it as "system"
        # (OpenAI's developer message is the system instruction; Qwen2.5's template dropped it silently and
        # wrote its default system prompt instead: a review; llama.cpp maps it so, vLLM passes it on as is)
        self.knows_developer = re.search(r"""['"]developer['"]""", source) is not None
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template from {origin} does not compile: {e.message} (line {e.lineno})") \
                from None
        except RecursionError:  # the parser's own stack: a traceback at start-up before (a review)
            raise ValueError(f"chat template from {origin} nests too deeply to compile") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, variables: dict | None = None,
               **named) -> str:
        """`variables` (a request's chat_template_kwargs) and `named`: special tokens (bos_token, ...) and any
        extra ones, of any names (they go to jinja as one context dict: a variable called `self` collides
        with nothing). Raises ChatTemplateError when the template rejects the messages or its variables: a
        jinja error, or a Python one its expressions raise on the request's values (iterating an int given
        as `tools`)."""
        if self.tool_use is not None and (variables or {}).get("tools"):
            return self.tool_use.render(messages, add_generation_prompt, variables, **named)
        # tools and documents are defined (None) as transformers passes them: `{% if tools is not none %}`
        context = {"tools": None, "documents": None, **named, **(variables or {}),
                   "messages": [self._as_known_role(_plain_message(m)) for m in messages],
                   "add_generation_prompt": add_generation_prompt}
        try:
            return contextvars.copy_context().run(self._render, context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from None
        # RecursionError (a RuntimeError): a template that walks a client's deeply nested tool schema
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError,
                RuntimeError) as e:
            raise ChatTemplateError(f"the chat template failed on this request: {type(e).__name__}: {e}") \
                from None


    def _render(self, context: dict) -> str:
        _range_left.set(MAX_RANGE_ELEMENTS)  # (in a copied context: each render its own budget)
        return self._template.render(context)

    def check_renders(self, timeout_s: float = RENDER_CHECK_S) -> None:
        """A ValueError unless a two-message conversation renders within `timeout_s` (its own errors are
        the request's): a template that loops on every input stops start-up, not the server's event loop
        at its first chat request (a review). The render runs in a daemon thread, left behind on failure."""
        done = threading.Event()

        def render():
            try:
                self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
            except Exception:  # noqa: BLE001 -- a template refusing these messages renders others
                pass
            done.set()

        threading.Thread(target=render, name="pagewalk-template-check", daemon=True).start()
        if not done.wait(timeout_s):
            raise ValueError(f"chat template from {self.origin} did not render a two-message conversation "
                             f"in {timeout_s:.0f} s")

    def _as_known_role(self, message: dict) -> dict:
        if message.get("role") == "developer" and not self.knows_developer:
            return {**message, "role": "system"}
        return message


def template_file(path: Path | str, tool_use: ChatTemplate | None = None) -> ChatTemplate:
    """A chat template file (UTF-8 jinja) -> its template; an unreadable file is a ValueError naming it."""
    try:
        return ChatTemplate(Path(path).read_text(encoding="utf-8"), str(path), tool_use)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template {path}: {e}") from None


def load_chat_template(value: str) -> ChatTemplate:
    """`--chat-template`: a path to a template file, or the template text itself."""
    try:
        is_file = Path(value).is_file()
    except OSError:  # template text too long to be a path
        is_file = False
    if is_file:
        return template_file(value)
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja template")
    return ChatTemplate(value, "--chat-template")


def _plain_message(message: dict) -> dict:
    """OpenAI content parts ([{"type": "text", "text": ...}]) are joined into one string."""
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))  # as vLLM joins them
    return {**message, "content": "" if content is None else content}
