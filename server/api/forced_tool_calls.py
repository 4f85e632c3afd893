"""Chat tool_choice "required" or a named function: the reply is tool calls by construction, a JSON text its
grammar forces (structured_output.py compiles the schema here), as vLLM serves them, without
--enable-auto-tool-choice.

- named, {"type": "function", "function": {"name": f}}: the reply is f's arguments, JSON that follows f's
  `parameters` (none: any JSON object); it comes back as one call of f with content null and finish "stop"
  (OpenAI's and vLLM's: the call was asked for, not chosen), a cut reply's arguments as far as they go;
- "required": the reply is a JSON array of {"name": a tool's name, "parameters": its arguments}, at least one
  (at most one with parallel_tool_calls false); each item comes back as a call, finish "tool_calls". A reply
  cut before its array closes (max_tokens) is content, as written, with no calls.
Streamed, a named function's call goes out as the reply is generated: its id, type and name with the first
piece of its arguments, then each next piece (OpenAI's form); a "required" reply is held and its calls go
out whole in one delta when the choice ends, as auto calls do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from server.api.errors import APIError
from server.api.protocol import ChatCompletionRequest, DeltaFunction, DeltaToolCall, Tool
from server.api.tool_calls import ToolCall

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ForcedCalls:
    """How a forced reply becomes calls: `name`, the named function's; None for "required"."""

    name: str | None

    @property
    def finish_reason(self) -> str:
        """A reply that ended on a stop (the grammar complete) ends with this."""
        return "tool_calls" if self.name is None else "stop"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's text -> (content, calls), as tool_calls.parse: the named function's one call, or the
        array's calls; an array that does not parse (a cut reply) is content without calls."""
        if self.name is not None:
            return None, [ToolCall(self.name, text)]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(items, list) or not all(_is_call(item) for item in items):
            return text, []
        return None, [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                      for item in items]

    def stream(self) -> HeldReply | NamedCallStream:
        return HeldReply(self) if self.name is None else NamedCallStream(self.name)


class HeldReply:
    """A streamed forced reply (ToolCallStream's interface): all of it is held, and parsed when it ends."""

    def __init__(self, forced: ForcedCalls) -> None:
        self.forced = forced
        self.held = ""

    def feed(self, text: str) -> str:
        self.held += text
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self.held = self.held, ""
        content, calls = self.forced.parse(held)
        return content or "", calls


class NamedCallStream:
    """A streamed named call: piece(text) gives the DeltaToolCall that carries the next piece of its
    arguments, the first one with the call's id, type and name."""

    def __init__(self, name: str) -> None:
        self.call = ToolCall(name, "")
        self.started = False

    def piece(self, text: str) -> DeltaToolCall:
        if self.started:
            return DeltaToolCall(index=0, function=DeltaFunction(arguments=text))
        self.started = True
        return DeltaToolCall(index=0, id=self.call.id, type="function",
                             function=DeltaFunction(name=self.call.name, arguments=text))


def forced_calls(req: ChatCompletionRequest) -> ForcedCalls | None:
    """The request's forced calls, None unless tool_choice is "required" or names a function."""
    if req.tool_choice is None or isinstance(req.tool_choice, str) and req.tool_choice != "required":
        return None
    return ForcedCalls(None if req.tool_choice == "required" else req.tool_choice.function.name)


def forced_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a forced reply follows, None when tool_choice forces nothing; a 400 for a tool_choice
    without tools or naming a function that is not among them."""
    forced = forced_calls(req)
    if forced is None:
        return None
    if not req.tools:
        shown = '"required"' if forced.name is None else f"naming '{forced.name}'"
        raise APIError(400, f"tool_choice {shown} needs 'tools'.", "tool_choice")
    if forced.name is None:
        return _calls_schema(req.tools, req.parallel_tool_calls is not False)
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


def _is_call(item) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item
