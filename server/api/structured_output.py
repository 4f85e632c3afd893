"""A request's structured output -> the llguidance grammar its SamplingParams carry (the core builds a
matcher from it, masks each step's logits and ends the choice when the grammar is complete).

The sources, at most one per request (two are a 400 naming the second):
- response_format (OpenAI's): text -> no grammar; json_object -> any JSON object; json_schema -> its schema;
- structured_outputs (vLLM's): exactly one of json (a schema, or its JSON text), regex, choice, grammar (Lark
  or llama.cpp's GBNF), json_object;
- guided_json, guided_regex, guided_choice, guided_grammar (vLLM's legacy fields, with the same meanings);
- chat tool_choice "required" or a named function (forced_tool_calls.py gives the schema).
JSON compiles compact: no whitespace between tokens, where a small model may otherwise loop on newlines; a
schema's own "x-guidance" options still override that. Every grammar is validated here, so that a bad one is
a 400 naming its field rather than an error from the core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import llguidance
from llguidance import LLMatcher, LLParserLimits

from server.api.errors import APIError
from server.api.forced_tool_calls import forced_schema
from server.api.protocol import ChatCompletionRequest, _SamplingRequest
from server.engine.sampling_params import MAX_GRAMMAR_CHARS

ANY_OBJECT = {"type": "object"}
JSON_DEFAULTS = {"whitespace_flexible": False}  # llguidance JsonCompileOptions, under the schema's own
# llguidance's defaults but for the grammar's symbols (500_000): a request's grammar stays well below them.
# initial_lexer_fuel bounds the lexer's build (~50k/ms: ~20 ms). Neither bounds the JSON schema compile:
# its time grows with the schema (optional properties ~quadratically), which the body limit (1 MiB) bounds.
LIMITS = LLParserLimits(max_grammar_size=200_000, initial_lexer_fuel=1_000_000)
MAX_ERROR_CHARS = 1000  # llguidance's messages quote the grammar: a huge one is cut


@dataclass(frozen=True)
class Grammar:
    text: str  # an llguidance grammar (LLMatcher.grammar_from_*'s text)
    param: str  # the request field it comes from: its errors name it


def grammar_of(req: _SamplingRequest) -> Grammar | None:
    """The request's structured output as a grammar, None for free text; a 400 naming the field for two
    sources or a value that does not compile (validate checks the grammar itself)."""
    sources = _sources(req)
    if len(sources) > 1:
        names = ", ".join(param for param, _ in sources)
        raise APIError(400, f"A request takes one structured output, got {names}.", sources[1][0])
    if not sources:
        return None
    param, build = sources[0]
    try:
        text = build()
    except ValueError as e:  # JSON text that does not parse, GBNF that does not convert
        raise APIError(400, f"Invalid '{param}': {e}", param, "invalid_grammar") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"Invalid '{param}': the grammar has {len(text)} characters, more than "
                            f"{MAX_GRAMMAR_CHARS}.", param, "invalid_grammar")
    return Grammar(text, param)


def validate(grammar: Grammar) -> None:
    """A 400 naming the grammar's field unless llguidance accepts it (within LIMITS). Blocking: a realistic
    schema takes 0.3-0.5 ms, a regex or Lark grammar ~0.8 ms, a 300-property schema 5-12 ms, 3000 properties
    ~0.3 s and 10000 optional ones ~2.6 s (llguidance 1.9.1, one CPU core); it drops the GIL."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar.text, limits=LIMITS)
    if is_error:
        message = messages[0] if messages else "the grammar is invalid"
        raise APIError(400, f"Invalid '{grammar.param}': {message[:MAX_ERROR_CHARS]}", grammar.param,
                       "invalid_grammar")


async def request_grammar(req: _SamplingRequest) -> str | None:
    """grammar_of, validated off the event loop (validate can take seconds): the text for SamplingParams."""
    grammar = grammar_of(req)
    if grammar is None:
        return None
    await asyncio.to_thread(validate, grammar)
    return grammar.text


def json_grammar(schema: dict[str, Any] | str | None) -> str:
    """A JSON schema (a dict or its JSON text; None: any JSON object) -> its compact JSON grammar."""
    return LLMatcher.grammar_from_json_schema(ANY_OBJECT if schema is None else schema,
                                              defaults=JSON_DEFAULTS)


def _sources(req: _SamplingRequest) -> list[tuple[str, Callable[[], str]]]:
    """(field, grammar builder) of every structured output the request sets."""
    sources = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        sources.append(("response_format", partial(json_grammar, schema)))
    so = req.structured_outputs
    if so is not None:
        ((kind, value),) = so.given().items()  # the model validated exactly one
        sources.append(("structured_outputs", partial(_vllm_grammar, kind, value)))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            sources.append((f"guided_{kind}", partial(_vllm_grammar, kind, value)))
    if isinstance(req, ChatCompletionRequest):
        schema = forced_schema(req)
        if schema is not None:
            sources.append(("tool_choice", partial(json_grammar, schema)))
    return sources


def _vllm_grammar(kind: str, value) -> str:
    """One of vLLM's structured outputs -> its grammar."""
    if kind in ("json", "json_object"):
        return json_grammar(value if kind == "json" else None)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "choice":  # Lark alternatives of the strings, quoted as JSON
        return llguidance.grammar_from("choice", value)
    return llguidance.grammar_from("grammar", value)  # Lark, or GBNF converted to Lark
