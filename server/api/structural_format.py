"""xgrammar's structural tag format, the later form of vLLM's structural tag ({"type": "structural_tag",
"format": {...}}): a tree of format nodes, each a model told apart by its "type" (format_grammar.py turns a
tree into one grammar). A field pagewalk does not know is a 400 naming it, never silently dropped (xgrammar
adds fields; one dropped would loosen the constraint), and so is a type it does not serve (xgrammar's
optional, plus, star, repeat, dispatch and token-level nodes).

Free text (any_text, and triggered_tags unless they are one tag alone) runs until a literal ends it: the
first end written of the nearest tag around it, the const_string right after it in a sequence, or else the
end of the output; free text that nothing ends is a 400 where it is (it would swallow what follows it). The
tree is bounded before its nodes are validated (bounded: depth, nodes, text), so that a request can make
neither a grammar without bound nor a validation that recurses without bound.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, model_validator
from pydantic import Tag as Member

from server.api.grammar_texts import MAX_CFG_CHARS
from server.api.trigger_index import TriggerIndex
from server.engine.sampling_params import MAX_GRAMMAR_CHARS

NODE_TYPES = ("const_string", "json_schema", "regex", "grammar", "any_text", "sequence", "or", "tag",
              "triggered_tags", "tags_with_separator")
# nodes from the root to a leaf: a tool-calling tree takes 4 (sequence > triggered_tags > tag > json_schema)
MAX_FORMAT_DEPTH = 16
MAX_FORMAT_NODES = 1024  # each node is a rule or two of the grammar: a tool-calling tree takes ~2 a tool
MAX_FORMAT_CHARS = MAX_GRAMMAR_CHARS  # the tree as JSON text: its grammar holds each string and schema of it
# a node's tags and a triggered_tags' triggers (and a structural tag's structures and triggers): a
# tool-calling tree takes a tag a tool, and a trigger for all or one for each (OpenAI takes 128 tools at most)
MAX_TAGS = 256
MAX_TRIGGERS = 256
Text = Annotated[str, Field(min_length=1)]  # a trigger or an exclude: an empty one would match everywhere


class _Node(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @property
    def unlimited(self) -> bool:
        """Whether its text may run on without end (free text): a literal must end it, or the output."""
        return False


class ConstString(_Node):
    """Exactly `value`."""

    type: Literal["const_string"]
    value: str


class JsonSchema(_Node):
    """JSON that follows `json_schema`, compact (as every schema pagewalk compiles)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any]
    style: Literal["json"] = "json"  # xgrammar's XML argument styles are not served
    any_order: Literal[False] = False  # properties come in the schema's order


class Regex(_Node):
    """Text that `pattern` matches whole."""

    type: Literal["regex"]
    pattern: str

    @model_validator(mode="after")
    def _no_lone_backslash(self):
        check_regex(self.pattern, "'pattern'")
        return self


def check_regex(pattern: str, what: str = "the regex") -> str:
    """`pattern`, or ValueError where it ends with a lone backslash: llguidance's regex_to_lark (and
    grammar_from_regex) drop it, which would serve a pattern that is none ("ab\\" as /ab/)."""
    if (len(pattern) - len(pattern.rstrip("\\"))) % 2:
        raise ValueError(f"{what} ends with a lone backslash")
    return pattern


class Grammar(_Node):
    """Text of a context-free grammar: Lark, or GBNF (xgrammar's EBNF: `root ::= ...`). It is embedded as a
    grammar of its own (its rules, lexer and %ignore stay its own)."""

    type: Literal["grammar"]
    grammar: str


class AnyText(_Node):
    """Free text holding none of `excludes` (nor the literal that ends it)."""

    type: Literal["any_text"]
    excludes: list[Text] = []
    max_tokens: None = None  # xgrammar's budgets are not served
    max_chars: None = None

    @property
    def unlimited(self) -> bool:
        return True


class Sequence(_Node):
    """Its elements, one after the other."""

    type: Literal["sequence"]
    elements: list[Format] = Field(min_length=1)

    @property
    def unlimited(self) -> bool:
        return self.elements[-1].unlimited

    @model_validator(mode="after")
    def _free_text_ends(self):
        for i, (element, after) in enumerate(zip(self.elements[:-1], self.elements[1:], strict=True)):
            if element.unlimited and not (isinstance(after, ConstString) and after.value):
                raise ValueError(f"elements[{i}] is free text that nothing ends: free text ends the format, "
                                 "ends a tag's content or comes right before a non-empty const_string")
        return self


class Or(_Node):
    """One of its elements."""

    type: Literal["or"]
    elements: list[Format] = Field(min_length=1)

    @property
    def unlimited(self) -> bool:
        return any(element.unlimited for element in self.elements)


class Tag(_Node):
    """`begin`, its content, `end` (free text in the content runs until the first `end`)."""

    type: Literal["tag"] = "tag"  # a tag of triggered_tags or tags_with_separator may leave it out
    begin: str
    content: Format
    end: str

    @property
    def unlimited(self) -> bool:
        return not self.end and self.content.unlimited


def _ended(tags: list[Tag]) -> None:
    for i, tag in enumerate(tags):
        if tag.unlimited:
            raise ValueError(f"tags[{i}] has an empty end after free text: nothing would end it")


class TriggeredTags(_Node):
    """Free text in which each trigger the model writes opens the tag whose begin starts with it; after the
    tag's end, free text again. at_least_one: a tag first, no text before it; stop_after_first: nothing
    after the first tag (both: exactly one tag)."""

    type: Literal["triggered_tags"]
    triggers: list[Text] = Field(min_length=1, max_length=MAX_TRIGGERS)
    tags: list[Tag] = Field(min_length=1, max_length=MAX_TAGS)
    at_least_one: bool = False
    stop_after_first: bool = False
    excludes: list[Text] = []  # the free text holds none of them

    @property
    def unlimited(self) -> bool:
        return not (self.at_least_one and self.stop_after_first)

    @functools.cached_property
    def trigger_index(self) -> TriggerIndex:
        return TriggerIndex(self.triggers)

    def openers(self) -> list[str]:
        """The one trigger each tag's begin starts with (_one_trigger_a_tag), in the tags' order."""
        return [self.trigger_index.shortest(tag.begin) for tag in self.tags]

    @model_validator(mode="after")
    def _one_trigger_a_tag(self):
        """xgrammar's rule: each tag's begin starts with exactly one trigger, which dispatches to it."""
        for i, tag in enumerate(self.tags):
            count = self.trigger_index.count(tag.begin)
            if count != 1:
                raise ValueError(f"tags[{i}].begin {json.dumps(tag.begin)} starts with {count} of the "
                                 f"triggers {json.dumps(self.triggers)}, not exactly one")
        _ended(self.tags)
        return self


class TagsWithSeparator(_Node):
    """Its tags, `separator` between each two, nothing else. at_least_one: not none; stop_after_first: one
    at most (so too where the separator is the literal after it, as in xgrammar)."""

    type: Literal["tags_with_separator"]
    tags: list[Tag] = Field(min_length=1, max_length=MAX_TAGS)
    separator: str
    at_least_one: bool = False
    stop_after_first: bool = False

    @model_validator(mode="after")
    def _tags_ended(self):
        _ended(self.tags)
        return self


class FormatNode(_Node):
    """The member for a node of no type in NODE_TYPES: its validation fails, naming the node's 'type'
    (missing, or not one of them), or the node where it is no object ("... instance of FormatNode")."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal[NODE_TYPES]


def _node_type(node: Any) -> str:
    """The union member that validates `node`: its type's, tagged "type=..." (errors.py leaves the tag out
    of the field it names)."""
    kind = node.get("type") if isinstance(node, dict) else getattr(node, "type", None)
    return f"type={kind}" if isinstance(kind, str) and kind in NODE_TYPES else "type=?"


Format = Annotated[
    Annotated[ConstString, Member("type=const_string")] | Annotated[JsonSchema, Member("type=json_schema")]
    | Annotated[Regex, Member("type=regex")] | Annotated[Grammar, Member("type=grammar")]
    | Annotated[AnyText, Member("type=any_text")] | Annotated[Sequence, Member("type=sequence")]
    | Annotated[Or, Member("type=or")] | Annotated[Tag, Member("type=tag")]
    | Annotated[TriggeredTags, Member("type=triggered_tags")]
    | Annotated[TagsWithSeparator, Member("type=tags_with_separator")]
    | Annotated[FormatNode, Member("type=?")],
    Discriminator(_node_type)]

for _model in (Sequence, Or, Tag, TriggeredTags, TagsWithSeparator):
    _model.model_rebuild()


def bounded(tree: Any) -> Any:
    """The tree as sent, checked against the bounds before pydantic walks it (depth first, on a stack of
    its own): at most MAX_FORMAT_DEPTH deep, MAX_FORMAT_NODES nodes, MAX_FORMAT_CHARS of JSON, and
    MAX_CFG_CHARS of grammar nodes' text (each converted in Python in time quadratic in its rules)."""
    if not isinstance(tree, dict):
        return tree  # a model already (a request built in Python), or no node: its validation says so
    stack, nodes, cfg_chars = [(tree, 1)], 0, 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if depth > MAX_FORMAT_DEPTH:
            raise ValueError(f"the format nests more than {MAX_FORMAT_DEPTH} nodes deep")
        if nodes > MAX_FORMAT_NODES:
            raise ValueError(f"the format has more than {MAX_FORMAT_NODES} nodes")
        if node.get("type") == "grammar" and isinstance(node.get("grammar"), str):
            cfg_chars += len(node["grammar"])
        stack.extend((child, depth + 1) for child in _children(node))
    if cfg_chars > MAX_CFG_CHARS:
        raise ValueError(f"its grammar nodes hold {cfg_chars} characters, more than {MAX_CFG_CHARS}")
    chars = len(json.dumps(tree, ensure_ascii=False))
    if chars > MAX_FORMAT_CHARS:
        raise ValueError(f"the format has {chars} characters of JSON, more than {MAX_FORMAT_CHARS}")
    return tree


def _children(node: dict) -> list[dict]:
    """The nodes under a node as sent (what is not an object is its validation's to refuse)."""
    found = [node.get("content")]
    for key in ("elements", "tags"):
        if isinstance(node.get(key), list):
            found.extend(node[key])
    return [child for child in found if isinstance(child, dict)]


BoundedFormat = Annotated[Format, BeforeValidator(bounded)]
