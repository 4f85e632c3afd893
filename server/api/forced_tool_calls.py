"""Chat tool_choice "required" or a named function: the reply is tool calls by construction, a JSON text its
grammar forces (structured_output.py compiles the schema here), as vLLM serves them, without
--enable-auto-tool-choice.

- named, {"type": "function", "function": {"name": f}}: the reply is f's arguments, JSON that follows f's
  `parameters` (none: any JSON object); it comes back as one call of f with content null and finish "stop"
  (OpenAI's and vLLM's: the call was asked for, not chosen), a cut reply's arguments as far as they go;
- "required": the reply is a JSON array of {"name": a tool's name, "parameters": its arguments}, at least one
  (at most one with parallel_tool_calls false); each item comes back as a call whose arguments are the exact
  text of its "parameters" value (compact, as generated), finish "tool_calls". A reply cut before its array
  closes (max_tokens) is content, as written, with no calls.
Streamed, each call goes out as the reply is generated (OpenAI's form, as vLLM streams them): its id, type
and name with the first piece of its arguments ("" where none is generated yet), then each next piece; the
pieces of a call join into the unary reply's arguments. A named call's first delta goes out at once, a
"required" call's once its name is complete (call_array.py scans the array). A streamed reply cut mid-array
ends with the calls and pieces already sent; one cut before its first call is content, as unary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.api.call_array import CallArrayScanner
from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest, DeltaFunction, DeltaToolCall, Tool
from server.api.tool_calls import ToolCall

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ForcedCalls:
    """How a forced reply becomes calls: `name`, the named function's; None for "required", whose stream sends
    the first call alone unless `parallel` (parallel_tool_calls)."""

    name: str | None
    parallel: bool = True

    @property
    def finish_reason(self) -> str:
        """A reply that ended on a stop (the grammar complete) ends with this."""
        return "tool_calls" if self.name is None else "stop"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's text -> (content, calls), as tool_calls.parse: the named function's one call, or the
        array's calls, each with its "parameters" text as the stream sends it; a reply that is not a closed
        array of calls in JSON (a cut reply) is content without calls."""
        if self.name is not None:
            return None, [ToolCall(self.name, text)]
        scanner = CallArrayScanner()
        pieces, content = scanner.feed(text)
        if content or not scanner.complete or not _is_json(text):
            return text, []
        calls: list[ToolCall] = []
        for piece in pieces:
            if piece.name is not None:
                calls.append(ToolCall(piece.name, piece.arguments))
            else:
                calls[-1].arguments += piece.arguments
        return None, calls

    def stream(self) -> NamedCallStream | RequiredCallStream:
        if self.name is not None:
            return NamedCallStream(self.name)
        return RequiredCallStream(None if self.parallel else 1)


class NamedCallStream:
    """A streamed named call: feed(text) -> (content: none; the DeltaToolCall that carries the next piece of
    its arguments, the first one, even empty, with the call's id, type and name)."""

    complete = True  # its finish reason is "stop" however the reply ended (finish_with_calls)

    def __init__(self, name: str) -> None:
        self.call = ToolCall(name, "")
        self.started = False

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        if self.started:
            return "", [_call_delta(0, text)] if text else []
        self.started = True
        return "", [_call_delta(0, text, self.call)]

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        return "", []


class RequiredCallStream:
    """A streamed "required" reply: feed(text) -> (the content it gives: none while it keeps the array's
    shape; the DeltaToolCalls it gives: a call's id, type and name once its name is complete, then the
    pieces of its "parameters" text), calls past `max_calls` left out."""

    def __init__(self, max_calls: int | None) -> None:
        self.scanner = CallArrayScanner()
        self.max_calls = max_calls

    @property
    def started(self) -> bool:
        """Whether a call has gone out."""
        return self.scanner.calls > 0

    @property
    def complete(self) -> bool:
        """Whether the calls are whole (the array closed): a reply that stopped before (a stop string) has a
        cut call."""
        return self.scanner.closed

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        pieces, content = self.scanner.feed(text)
        deltas = [_call_delta(p.index, p.arguments, None if p.name is None else ToolCall(p.name, ""))
                  for p in pieces if self.max_calls is None or p.index < self.max_calls]
        return content, deltas

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """The reply ended: a reply in which no call began is content; a cut call stays as far as it went."""
        return self.scanner.finish(), []


def _call_delta(index: int, arguments: str, call: ToolCall | None = None) -> DeltaToolCall:
    """The DeltaToolCall of call `index` carrying a piece of its arguments; a call's first, given the call,
    also carries its id, type and name."""
    if call is None:
        return DeltaToolCall(index=index, function=DeltaFunction(arguments=arguments))
    return DeltaToolCall(index=index, id=call.id, type="function",
                         function=DeltaFunction(name=call.name, arguments=arguments))


def forced_calls(req: ChatCompletionRequest) -> ForcedCalls | None:
    """The request's forced calls, None unless tool_choice is "required" or names a function."""
    if req.tool_choice is None or isinstance(req.tool_choice, str) and req.tool_choice != "required":
        return None
    if req.tool_choice == "required":
        return ForcedCalls(None, req.parallel_tool_calls is not False)
    return ForcedCalls(req.tool_choice.function.name)


def forced_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a forced reply follows, None when tool_choice forces nothing; a 400 for a tool_choice
    but "none" without tools (as OpenAI's and vLLM's), one naming a function that is not among them, or
    tools too deeply nested to merge into the array's schema."""
    choice = req.tool_choice
    if choice not in (None, "none") and not req.tools:
        shown = f'"{choice}"' if isinstance(choice, str) else f"naming '{choice.function.name}'"
        raise APIError(400, f"tool_choice {shown} needs 'tools'.", "tool_choice")
    forced = forced_calls(req)
    if forced is None:
        return None
    if forced.name is None:
        try:
            return _calls_schema(req.tools, forced.parallel)
        except RecursionError:  # (a named function's schema goes to llguidance whole: its limit's 400)
            raise APIError(400, "A tool's parameters nest too deeply.", "tools") from None
    tool = next((t for t in req.tools if t.function.name == forced.name), None)
    if tool is None:
        raise APIError(400, f"tool_choice names '{forced.name}', which is not among the tools.",
                       "tool_choice")
    return tool.function.parameters or ANY_OBJECT


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of {"name": const, "parameters": that tool's schema}, any of the tools per item. Each
    tool's whole schema sits in the root's $defs as "tool_<i>", its root-relative references rewritten to
    point there: "#" still means the tool's parameters, and its own $defs or definitions stay inside it, so
    tools may define one name differently."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        name = f"tool_{i}"
        defs[name] = _rebased(tool.function.parameters or ANY_OBJECT, f"#/$defs/{name}")
        items.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"const": tool.function.name},
                                     "parameters": {"$ref": f"#/$defs/{name}"}}})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# Keywords whose values are JSON data, not schemas: a "$ref" in them is data and stays as written.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas: a name there ("$ref", "default") is no keyword.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                          "dependencies"})


def _rebased(node: Any, base: str) -> Any:
    """A copy of a schema moved to `base`: every root-relative $ref ("#", "#/...") is prefixed with it.
    A subschema with its own $id is a resource of its own, whose "#" already means itself: left as is."""
    if isinstance(node, list):
        return [_rebased(item, base) for item in node]
    if not isinstance(node, dict) or _is_resource(node):
        return node
    return {key: _rebased_keyword(key, value, base) for key, value in node.items()}


def _rebased_keyword(key: str, value: Any, base: str) -> Any:
    if key == "$ref":
        return _rebased_ref(value, base)
    if key in _DATA_KEYWORDS:
        return value
    if key in _SCHEMA_MAPS and isinstance(value, dict):
        return {name: _rebased(schema, base) for name, schema in value.items()}
    return _rebased(value, base)


def _rebased_ref(ref: Any, base: str) -> Any:
    """A root-relative reference under `base` ("#" -> base, "#/a/b" -> base + "/a/b", its escapes kept);
    other references (URLs, "other.json#...", "#anchor") as they are."""
    if ref == "#" or isinstance(ref, str) and ref.startswith("#/"):
        return base + ref[1:]
    return ref


def _is_resource(node: dict[str, Any]) -> bool:
    """Whether the subschema sets a base URI ("$id" that is not a draft-07 "#anchor")."""
    return isinstance(node.get("$id"), str) and not node["$id"].startswith("#")


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True
