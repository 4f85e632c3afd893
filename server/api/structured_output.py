"""A request's structured output -> the llguidance grammar its SamplingParams carry (the core builds a
matcher from it, masks each step's logits and ends the choice when the grammar is complete).

The sources, at most one per request (two are a 400 naming the second):
- response_format (OpenAI's): text -> no grammar; json_object -> any JSON object; json_schema -> its schema;
  structural_tag (vLLM's) -> its structural tag (below);
- structured_outputs (vLLM's): exactly one of json (a schema, or its JSON text), regex, choice, grammar (Lark
  or llama.cpp's GBNF), json_object, structural_tag (the object, or its JSON text);
- guided_json, guided_regex, guided_choice, guided_grammar, structural_tag (vLLM's legacy fields, with the
  same meanings);
- chat tool_choice "required" or a named function (forced_tool_calls.py gives the schema).
A structural tag in its structures-and-triggers form is free text in which each trigger the model writes
opens a structure whose begin starts with it: the rest of that begin, a JSON value that follows its schema,
its end, then free text again (a lazy lexeme per trigger, as llguidance's StructTag); in its format form, a
tree of xgrammar's format nodes (structural_format.py, format_grammar.py; the first form becomes a
triggered_tags node). Where a trigger or another literal holds the text of a special token of the model's
tokenizer, the grammar takes that token there, or the text spelled (special_literals.py); the reply then
spells special tokens unless the request says otherwise (Grammar.special: sampling_params).
JSON compiles compact: no whitespace between tokens, where a small model may otherwise loop on newlines; a
schema's own "x-guidance" options still override that. Every grammar is built and checked here, on a worker
thread, against the model's vocabulary with the core's parser limits (server/engine/grammar.py check: it
compiles, allows a token, takes its first tokens), so that a bad one is a 400 naming its field rather than
an error from the core. The verdicts of the CHECKED_GRAMMARS most recent grammars are kept: a client that
sends one schema with every request has it compiled here once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial

import llguidance
from fastapi import Request
from llguidance import LLMatcher
from pydantic import BaseModel

from server.api.admission import RETRY_AFTER_S
from server.api.disconnects import ClientDisconnected, unless_disconnected
from server.api.errors import APIError
from server.api.forced_tool_calls import forced_schema
from server.api.format_grammar import format_grammar
from server.api.grammar_texts import cfg_lark, json_grammar
from server.api.protocol import (
    ChatCompletionRequest,
    ResponseFormat,
    StructuralTag,
    TagStructure,
    _SamplingRequest,
)
from server.api.special_literals import Literals, special_tokens
from server.api.structural_format import JsonSchema, Tag, TriggeredTags, check_regex
from server.api.trigger_index import TriggerIndex
from server.engine import grammar as core_grammar
from server.engine.forced_specials import ForcedSpecials
from server.engine.sampling_params import MAX_GRAMMAR_CHARS

# grammars whose check's verdict is kept: the verdicts hold no compiled state, their keys the texts (at most
# MAX_GRAMMAR_CHARS each: 8 MiB in all at worst)
CHECKED_GRAMMARS = 64
CHECK_THREADS = 2  # grammars checked at once (one may take a second: MAX_GRAMMAR_CHARS)


@dataclass(frozen=True)
class Grammar:
    text: str  # an llguidance grammar (LLMatcher.grammar_from_*'s text)
    param: str  # the request field it comes from: its errors name it
    special: bool = False  # whether a literal of it takes a special token (its reply then spells them)


Builder = Callable[[Literals], str]  # a grammar's text over the model's special tokens


def grammar_of(req: _SamplingRequest, tokenizer) -> Grammar | None:
    """The request's structured output as a grammar over the tokenizer's special tokens, None for free
    text; a 400 naming the field for two sources or a value that does not compile (validate checks the
    grammar itself)."""
    source = _source(req)
    return None if source is None else _build(*source, _literals(tokenizer))


def _source(req: _SamplingRequest) -> tuple[str, Builder] | None:
    """The request's one structured output (field, grammar builder), None for free text; a 400 for two.
    Cheap: nothing is built."""
    sources = _sources(req)
    if len(sources) > 1:
        names = ", ".join(param for param, _ in sources)
        raise APIError(400, f"A request takes one structured output, got {names}.", sources[1][0])
    return sources[0] if sources else None


def _build(param: str, build: Builder, literals: Literals) -> Grammar:
    try:
        text = build(literals)
    except ValueError as e:  # JSON text that does not parse, GBNF that does not convert
        raise APIError(400, f"Invalid '{param}': {e}", param, "invalid_grammar") from None
    except RecursionError:
        raise _too_deep(param) from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise APIError(400, f"Invalid '{param}': the grammar has {len(text)} characters, more than "
                            f"{MAX_GRAMMAR_CHARS}.", param, "invalid_grammar")
    return Grammar(text, param, literals.special)


def validate(grammar: Grammar, tokenizer, salt: str | None = None) -> None:
    """A 400 naming the grammar's field unless it can serve a request over the model's vocabulary
    (core_grammar.check, with the core's limits). Blocking: compiling a realistic schema takes ~0.5 ms, a
    regex or Lark grammar ~1 ms, a 300-property schema 5-12 ms, 3000 properties ~0.3 s (llguidance 1.9.1,
    one CPU core; MAX_GRAMMAR_CHARS bounds it); it drops the GIL. The vocabulary is built on first use.
    Verdicts are kept per request cache `salt`: a kept one answers at once, so tenants that salt apart
    would otherwise time whether another sent the same schema."""
    vocab = _vocabulary(tokenizer)  # (a 400 where llguidance cannot read the tokenizer)
    forced = core_grammar.forced_specials(tokenizer, tokenizer.eos_token_ids)
    error = _check(vocab, forced, grammar.text, salt)
    if error is not None:
        raise APIError(400, f"Invalid '{grammar.param}': {error}", grammar.param, "invalid_grammar")


@lru_cache(maxsize=CHECKED_GRAMMARS)
def _check(vocab: llguidance.LLTokenizer, forced: ForcedSpecials, text: str,
           salt: str | None) -> str | None:
    """core_grammar.check, remembered for each (vocabulary, grammar, cache salt) (the vocabulary and its
    ForcedSpecials are one per tokenizer: core_grammar.vocabulary; the salt is part of the key alone)."""
    return core_grammar.check(vocab, text, forced)


def _vocabulary(tokenizer) -> llguidance.LLTokenizer:
    """The model's vocabulary as llguidance reads it (core_grammar.vocabulary: built once per tokenizer)."""
    try:
        return core_grammar.vocabulary(tokenizer, tokenizer.eos_token_ids)
    except core_grammar.GrammarError as e:
        raise APIError(400, str(e), None, "structured_outputs_unavailable") from None


def _literals(tokenizer) -> Literals:
    """A grammar's literals over the tokenizer's special tokens (special_literals.special_tokens)."""
    return Literals(special_tokens(tokenizer, _vocabulary(tokenizer)))


def _checked(param: str, build: Builder, tokenizer, salt: str | None) -> Grammar:
    grammar = _build(param, build, _literals(tokenizer))
    validate(grammar, tokenizer, salt)
    return grammar


class GrammarChecks:
    """The API's grammar checks: CHECK_THREADS threads of their own (not the event loop's default executor,
    which shutdown uses), as many queued or running as the server has places for requests (pending_limit).
    They run before admission, so this bound is theirs: a client sending grammars that take a second each
    and hanging up parked unbounded work here (a review: a 20-character regex then waited 19 s, and SIGTERM
    20 s); a hung-up client's queued check is dropped. A source of up to SMALL_GRAMMAR_CHARS characters is
    checked on CHECK_THREADS threads of its own, as the core compiles them apart: a regex waited 23 s behind
    sixteen 125K-character schemas in one queue (a review)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="pagewalk-check")
        self.small_pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="pagewalk-check-small")
        self.pending = 0  # (the event loop's thread alone counts)

    async def run(self, request: Request, limit: int, param: str, build: Builder, tokenizer,
                  salt: str | None = None, stopping: Callable[[], bool] | None = None) -> Grammar:
        """_checked on a check thread; a 429 with `limit` checks pending (pending_limit); dropped (a 499)
        when the client goes away first (a check not started never starts); a 503 once `stopping()`."""
        if self.pending >= limit:
            raise APIError(429, f"{limit} structured outputs are being checked; retry later.", param,
                           "too_many_grammar_checks", {"Retry-After": str(RETRY_AFTER_S)})
        try:
            chars = _source_chars(build)
        except (RecursionError, ValueError):  # json.dumps's stack, pydantic's serialisation depth limit
            raise _too_deep(param) from None
        self.pending += 1
        try:
            pool = self.small_pool if chars <= core_grammar.SMALL_GRAMMAR_CHARS else self.pool
            work = asyncio.get_running_loop().run_in_executor(pool, _checked, param, build, tokenizer, salt)
            return await unless_disconnected(request, work, stopping)
        except ClientDisconnected:
            raise APIError(499, "The client went away while its structured output was checked.") from None
        finally:
            self.pending -= 1


def _source_chars(build: Builder) -> int:
    """The characters of a grammar's source (a schema's JSON, a regex, the choices, a tag), as it was sent:
    ~1 ms for the largest a body may hold, against a second to check its grammar."""
    chars = 0
    for arg in getattr(build, "args", ()):
        if isinstance(arg, str):
            chars += len(arg)
        elif isinstance(arg, BaseModel):
            chars += len(arg.model_dump_json())
        else:
            chars += len(json.dumps(arg, default=str))
    return chars


def _too_deep(param: str) -> APIError:
    """A source nested past what Python serialises or walks (~1,000 levels; the body parser takes them): a
    500 before (a review)."""
    return APIError(400, f"Invalid '{param}': it nests too deeply.", param, "invalid_grammar")


def pending_limit(engine) -> int:
    """Checks queued or running at most: the requests the server can hold (its waiting queue and running
    sequences), so that a burst it would admit is never refused here (each check, a verdict kept or a
    regex, takes ~0.1 ms)."""
    return engine.max_waiting + engine.config.max_num_seqs


_CHECKS = GrammarChecks()


async def request_grammar(request: Request, req: _SamplingRequest, tokenizer) -> Grammar | None:
    """The request's grammar (grammar_of), checked (validate), for SamplingParams (sampling_params). Both
    run on a check thread (GrammarChecks): building converts GBNF in Python, checking compiles the
    grammar."""
    source = _source(req)
    if source is None:
        return None
    engine = request.app.state.engine
    return await _CHECKS.run(request, pending_limit(engine), *source, tokenizer, req.cache_salt,
                             lambda: not engine.accepting)


def _sources(req: _SamplingRequest) -> list[tuple[str, Builder]]:
    """(field, grammar builder) of every structured output the request sets. A forcing `tool_choice` wins
    over OpenAI's JSON `response_format`, which shapes a text reply that such a turn does not give (OpenAI
    accepts the two together, its Agents SDK sends them, vLLM's tool schema overrides the format's); vLLM's
    structural tag, which shapes calls itself, stays a second source."""
    sources = []
    forced = forced_schema(req) if isinstance(req, ChatCompletionRequest) else None
    fmt = req.response_format
    if forced is not None and fmt is not None and fmt.type != "structural_tag":
        fmt = None
    if fmt is not None and fmt.type == "structural_tag":
        sources.append(("response_format", partial(tag_grammar, fmt)))
    elif fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        sources.append(("response_format", partial(_schema_grammar, schema)))
    so = req.structured_outputs
    if so is not None:
        ((kind, value),) = so.given().items()  # the model validated exactly one
        sources.append(("structured_outputs", partial(_vllm_grammar, kind, value)))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            sources.append((f"guided_{kind}", partial(_vllm_grammar, kind, value)))
    if req.structural_tag is not None:
        sources.append(("structural_tag", partial(_vllm_grammar, "structural_tag", req.structural_tag)))
    if forced is not None:
        sources.append(("tool_choice", partial(_schema_grammar, forced)))
    return sources


def _schema_grammar(schema: dict | None, literals: Literals) -> str:
    """A JSON schema's grammar (json_grammar): its literals are JSON's, never special tokens."""
    return json_grammar(schema)


def _vllm_grammar(kind: str, value, literals: Literals) -> str:
    """One of vLLM's structured outputs -> its grammar (a structural tag's over `literals`)."""
    if kind in ("json", "json_object"):
        return json_grammar(value if kind == "json" else None)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(check_regex(value))
    if kind == "choice":  # Lark alternatives of the strings, quoted as JSON
        return llguidance.grammar_from("choice", value)
    if kind == "structural_tag":
        return tag_grammar(value, literals)
    return LLMatcher.grammar_from_lark(cfg_lark(value))  # Lark, or GBNF converted to Lark


def tag_grammar(tag: StructuralTag | ResponseFormat, literals: Literals) -> str:
    """A structural tag in either of its forms -> its grammar (format_grammar.py): a format tree, or
    structures and triggers (structural_tag_format)."""
    if tag.format is not None:
        return format_grammar(tag.format, literals)
    return format_grammar(structural_tag_format(tag.structures, tag.triggers), literals)


def structural_tag_format(structures: list[TagStructure], triggers: list[str]) -> TriggeredTags:
    """Structures and triggers as the format tree of the same grammar (llguidance's StructTag's with text
    triggers, special tokens aside): free text in which each trigger the model writes goes on with one of
    the structures that begin with it, a compact JSON value of its schema, its end. Each structure opens at
    the shortest trigger its begin starts with (TagStructure.trigger), so each begin starts with exactly one
    of the triggers kept, as triggered_tags asks (a longer one that it starts with starts with the shorter,
    which opens every structure under the longer)."""
    index = TriggerIndex(triggers)
    opening = [s.trigger(index) for s in structures]
    tags = [Tag(begin=s.begin, content=JsonSchema(type="json_schema", json_schema=s.schema_), end=s.end)
            for s in structures]
    return TriggeredTags(type="triggered_tags", triggers=list(dict.fromkeys(opening)), tags=tags)
