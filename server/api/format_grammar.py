"""A structural tag's format tree (structural_format.py) -> one llguidance grammar: a Lark rule per node (a
few for triggered_tags), and a grammar of its own per grammar node (referenced as @g0, @g1, ...: its rules,
lexer and %ignore stay its own, and it must compile alone, so that its text cannot change the rest).

Each node's rule takes the node's text and then its stop, the literal that follows the node (a tag's end,
the const_string after it in a sequence), so that free text can end at the first stop written: free text
with a stop is a lazy lexeme, the text up to the stop (llguidance's StructTag does so with its triggers);
free text without one runs to the output's end. A stop is
- None: the output ends after the node;
- "": something follows that is not a literal (structural_format.py refuses free text here);
- text: that literal follows, taken by the node's rule.
Every literal is quoted Lark text, and where it holds the text of a special token of the model's tokenizer,
that token or the text (special_literals.py). Free text that a literal starting with such a text ends ends
at the literal's spelling (the lazy lexeme) or at the token (which free text never holds), then the rest of
the literal; one further into the literal is spelled there (the lazy lexeme's text). The pieces of a
sequence are lexed greedily, as any llguidance grammar is: a regex or JSON number that could go on into the
text after it does, so that text (e.g. a digit after an integer) is refused.
"""

from __future__ import annotations

import json

import llguidance
from llguidance import LLMatcher

from server.api.grammar_texts import cfg_lark, compact_schema
from server.api.special_literals import Literals
from server.api.structural_format import (
    AnyText,
    ConstString,
    Format,
    Grammar,
    JsonSchema,
    Or,
    Regex,
    Sequence,
    Tag,
    TagsWithSeparator,
    TriggeredTags,
)
from server.engine.grammar import brief
from server.engine.sampling_params import MAX_GRAMMAR_CHARS

ANY_TEXT = "/(?s:.*)/"


class _Rules:
    """The grammar being written: Lark lines (rules f0, f1, ...; terminals TEXT, TEXT3, ...), the grammars
    of grammar nodes (g0, g1, ...), its literals, the rule of each node built (by the node's id and its
    stop: the tree outlives the grammar's writing, so no two of its nodes share an id), and the characters
    written: past MAX_GRAMMAR_CHARS, a ValueError, as the finished grammar would be refused (its JSON holds
    every line and grammar), before more is built."""

    def __init__(self, literals: Literals) -> None:
        self.lines: list[str] = []
        self.grammars: list[dict[str, str]] = []
        self.literals = literals
        self.built: dict[tuple[int, str | None], str] = {}
        self.chars = 0
        self._write(f"TEXT: {ANY_TEXT}")

    def add(self, body: str, lazy: bool = False) -> str:
        name = f"f{len(self.lines)}"
        self._write(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def lit(self, text: str) -> str:
        """A literal as Lark: each special token's text in it the token or the text (special_literals.py).
        A line takes it, so the bound is checked first: splitting it is Python work per character."""
        self._bound(len(text))
        return self.literals.lark(text)

    def text(self, excludes: list[str]) -> str:
        """The terminal of free text holding none of `excludes`."""
        if not excludes:
            return "TEXT"
        name = f"TEXT{len(self.lines)}"
        banned = " | ".join(_spelled(e) for e in excludes)
        self._write(f"{name}: {ANY_TEXT} & ~({ANY_TEXT} ({banned}) {ANY_TEXT})")
        return name

    def grammar(self, text: str) -> str:
        """A grammar node's reference; a ValueError unless its text compiles alone: it may reference no
        other grammar (@format or @g1 would let it recurse into the rest of the tree)."""
        lark = cfg_lark(text)
        error = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark))
        if error:
            raise ValueError(f"a grammar node does not compile as a grammar of its own: {brief(error)}")
        name = f"g{len(self.grammars)}"
        self._count(len(lark))
        self.grammars.append({"name": name, "lark_grammar": lark})
        return f"@{name}"

    def _write(self, line: str) -> None:
        self._count(len(line) + 1)
        self.lines.append(line)

    def _count(self, chars: int) -> None:
        self._bound(chars)
        self.chars += chars

    def _bound(self, chars: int) -> None:
        """A ValueError where `chars` more characters would take the grammar past MAX_GRAMMAR_CHARS."""
        if self.chars + chars > MAX_GRAMMAR_CHARS:
            raise ValueError(f"the grammar has more than {MAX_GRAMMAR_CHARS} characters")


def format_grammar(fmt: Format, literals: Literals) -> str:
    """The format tree's grammar: llguidance's top-level JSON of the Lark grammar and its grammar nodes'.
    `literals`: the model's special tokens (its `special` tells whether the grammar takes one)."""
    rules = _Rules(literals)
    root = _node(rules, fmt, None)
    lark = "\n".join(["%llguidance {}", f"start: {root}", *rules.lines])
    return json.dumps({"grammars": [{"name": "format", "lark_grammar": lark}, *rules.grammars]})


def _spelled(text: str) -> str:
    """Text as a quoted Lark literal, special tokens' texts spelled ("": the empty string): a terminal's
    part (an exclude, the end of a lazy lexeme)."""
    return json.dumps(text)


def _then(rules: _Rules, body: str, stop: str | None) -> str:
    """`body`, then the stop's literal (if any)."""
    return f"{body} {rules.lit(stop)}" if stop else body


def _node(rules: _Rules, node: Format, stop: str | None) -> str:
    """The rule of the node's text followed by `stop` (the module's docstring), built once: a rule used
    twice is named twice (triggered_tags with at_least_one uses each tag's content twice, and a tree of
    them nested would otherwise double the grammar, and its work, at each level)."""
    key = (id(node), stop)
    if key not in rules.built:
        rules.built[key] = _new_node(rules, node, stop)
    return rules.built[key]


def _new_node(rules: _Rules, node: Format, stop: str | None) -> str:
    if isinstance(node, ConstString):
        return rules.add(rules.lit(node.value + (stop or "")))
    if isinstance(node, JsonSchema):
        return rules.add(_then(rules, f"%json {json.dumps(compact_schema(node.json_schema))}", stop))
    if isinstance(node, Regex):
        regex = llguidance.regex_to_lark(node.pattern, "")  # as the regex field's (no \d rewriting)
        return rules.add(_then(rules, f"/{regex}/" if regex else '""', stop))  # `//` would open a comment
    if isinstance(node, Grammar):
        return rules.add(_then(rules, rules.grammar(node.grammar), stop))
    if isinstance(node, AnyText):
        return _free_text(rules, rules.text(node.excludes), stop)
    if isinstance(node, Sequence):
        return _sequence(rules, node, stop)
    if isinstance(node, Or):
        return rules.add(" | ".join(_node(rules, element, stop) for element in node.elements))
    if isinstance(node, Tag):
        return _tag(rules, node, node.begin, stop)
    if isinstance(node, TriggeredTags):
        return _triggered_tags(rules, node, stop)
    assert isinstance(node, TagsWithSeparator), node
    return _tags_with_separator(rules, node, stop)


def _free_text(rules: _Rules, text: str, stop: str | None) -> str:
    """Free text up to the first `stop` (taken), or to the output's end."""
    assert stop != "", "free text that nothing ends (structural_format.py refuses it)"
    return rules.add(text) if stop is None else _text_up_to(rules, text, stop)


def _text_up_to(rules: _Rules, text: str, literal: str) -> str:
    """Free text up to the first `literal` written (taken): a lazy lexeme of its spelling; where the literal
    starts with a special token's text, or free text up to that token (free text never takes one) and the
    rest of the literal."""
    spelled = rules.add(f"{text} {_spelled(literal)}", lazy=True)
    leading = rules.literals.leading(literal)
    if leading is None:
        return spelled
    token, rest = leading
    return rules.add(f"{spelled} | {text} {token} {rules.lit(rest)}")


def _sequence(rules: _Rules, node: Sequence, stop: str | None) -> str:
    """Each element, free text taking the const_string after it as its stop."""
    parts, elements, i = [], node.elements, 0
    while i < len(elements):
        element, last = elements[i], i == len(elements) - 1
        if element.unlimited and not last:  # the const_string after it ends it (structural_format.py)
            parts.append(_node(rules, element, elements[i + 1].value))
            i += 2
            if i == len(elements) and stop:
                parts.append(rules.lit(stop))
            continue
        parts.append(_node(rules, element, stop if last else ""))
        i += 1
    return rules.add(" ".join(parts))


def _tag(rules: _Rules, tag: Tag, begin: str, stop: str | None) -> str:
    """`begin` (the tag's, or what follows its trigger), its content up to its end, then `stop`; with an
    empty end, what ends the content is the stop."""
    content = _node(rules, tag.content, tag.end or stop)
    return rules.add(_then(rules, f"{rules.lit(begin)} {content}", stop if tag.end else None))


def _triggered_tags(rules: _Rules, node: TriggeredTags, stop: str | None) -> str:
    """Free text and tags: each tag is free text up to its trigger (_text_up_to: a lazy lexeme, as
    llguidance's StructTag writes a trigger of text), then the rest of its begin, its content and its end;
    where its begin starts with a special token's text longer than the trigger (trigger "<tool", begin
    "<tool_call>"), or free text up to that token and the rest of its begin; the text after the last tag runs
    to the stop."""
    if node.at_least_one and node.stop_after_first:  # exactly one tag
        return rules.add(" | ".join(_tag(rules, tag, tag.begin, stop) for tag in node.tags))
    text = rules.text(node.excludes)
    tagged = []
    for tag, trigger in zip(node.tags, node.openers(), strict=True):
        opened = _text_up_to(rules, text, trigger)
        tagged.append(f"{opened} {_tag(rules, tag, tag.begin[len(trigger):], '')}")
        leading = rules.literals.leading(tag.begin)
        if leading is not None and len(tag.begin) - len(leading[1]) > len(trigger):
            token, rest = leading  # a special token holding the trigger: free text ends at it too
            tagged.append(f"{text} {token} {_tag(rules, tag, rest, '')}")
    tags, tail = f"({' | '.join(tagged)})", _free_text(rules, text, stop)
    if node.stop_after_first:  # free text, then one tag or none
        return rules.add(f"{_then(rules, tags, stop)} | {tail}")
    if not node.at_least_one:
        return rules.add(f"{tags}* {tail}")
    first = rules.add(" | ".join(_tag(rules, tag, tag.begin, "") for tag in node.tags))
    return rules.add(f"{first} {tags}* {tail}")


def _tags_with_separator(rules: _Rules, node: TagsWithSeparator, stop: str | None) -> str:
    """Tags with the separator between them; one at most after stop_after_first, or where the separator is
    the stop (xgrammar's rule: it ends the tags)."""
    tag = rules.add(" | ".join(_tag(rules, t, t.begin, "") for t in node.tags))
    separator = f"{rules.lit(node.separator)} " if node.separator else ""
    one = node.stop_after_first or (stop and node.separator == stop)
    tags = tag if one else f"{tag} ({separator}{tag})*"
    tags = rules.add(tags if node.at_least_one else f"{tags} | \"\"")
    return rules.add(_then(rules, tags, stop))
