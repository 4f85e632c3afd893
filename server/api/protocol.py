"""Pydantic request and response models of the OpenAI-compatible surface.

Requests are strict about the types of the fields they know (a string where a number belongs is a 400) and
ignore fields they do not know (OpenAI clients send extras). OpenAI fields pagewalk does not implement are
accepted only at a value that asks for nothing (`refused_unless`), never silently dropped; pure metadata
(user, metadata, service_tier, ...) is accepted and unused. Value ranges that need no engine knowledge are
checked here; token ids against the vocabulary are checked by the handlers.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from server.api.json_text import is_unicode, loads_finite
from server.api.request_ids import check_request_id
from server.api.structural_format import MAX_TAGS, MAX_TRIGGERS, BoundedFormat
from server.api.trigger_index import TriggerIndex
from server.engine.sampling_params import MAX_BAD_WORDS, check_cache_salt

NonNegInt = Annotated[int, Field(ge=0)]
# the sampler computes in float32: a larger temperature or penalty is inf there, a smaller positive penalty 0,
# and either turns a masked (-inf) logit into NaN
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
OmitIfNone = dict(default=None, exclude_if=lambda v: v is None)


def refused_unless(*no_ops: object) -> AfterValidator:
    """An OpenAI field pagewalk does not implement: a 400 naming it unless its value asks for nothing."""
    shown = " or ".join(json.dumps(v) for v in no_ops)

    def check(value):
        if value not in no_ops:
            raise ValueError(f"not supported by pagewalk (only {shown} is accepted)")
        return value

    return AfterValidator(check)


def _float32_finite(v: float | None) -> float | None:
    if v is not None and v > FLOAT32_MAX:
        raise ValueError(f"must be at most {FLOAT32_MAX:.4g} (float32), got {v:g}")
    return v


def _cache_salt(v: str | None) -> str | None:
    if v is not None:
        check_cache_salt(v)
    return v


def _float32_normal(v: float | None) -> float | None:
    if v is not None and not FLOAT32_TINY <= v <= FLOAT32_MAX:
        raise ValueError(f"must be in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (float32), got {v:g}")
    return v


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool | None = None  # None: as OpenAI's false, unless continuous_usage_stats asks (vLLM)
    # vLLM's: every chunk before the usage chunk carries the usage so far. vLLM's include_usage defaults to
    # true, so this field alone gives usage there, and here; an explicit include_usage false still wins
    continuous_usage_stats: bool | None = False


# A structured output's own objects refuse keys they do not know, as OpenAI's API does: a misspelt "schema"
# (or a schema given to json_object) was ignored and the reply was free JSON (a review)
STRICT_KEYS = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(_Request):
    """OpenAI's response_format.json_schema: the schema the reply's JSON follows."""

    model_config = STRICT_KEYS

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # pagewalk's replies always follow the schema


Trigger = Annotated[str, Field(min_length=1)]  # a structural tag's: text that opens a structure


class TagStructure(_Request):
    """One structure of a structural tag: its begin, a JSON value that follows its schema, its end."""

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str

    def trigger(self, triggers: TriggerIndex) -> str | None:
        """The trigger that opens it: the shortest its begin starts with (where one trigger starts another,
        the shorter one is written first, so a structure under the longer one would never open)."""
        return triggers.shortest(self.begin)


def _each_structure_triggered(structures: list[TagStructure], triggers: list[str]) -> None:
    index = TriggerIndex(triggers)
    for i, structure in enumerate(structures):
        if structure.trigger(index) is None:
            raise ValueError(f"structures[{i}].begin {json.dumps(structure.begin)} starts with none of the "
                             f"triggers {json.dumps(triggers)}")


def _one_form(structures: list[TagStructure] | None, triggers: list[str] | None, fmt: Any) -> None:
    """A structural tag is a format tree, or structures and triggers: exactly one of the two forms."""
    if fmt is not None and (structures is not None or triggers is not None):
        raise ValueError("give either 'format', or 'structures' and 'triggers', not both")
    if fmt is None and (structures is None or triggers is None):
        raise ValueError("a structural tag needs 'format', or 'structures' and 'triggers'")
    if fmt is None:
        _each_structure_triggered(structures, triggers)


class StructuralTag(_Request):
    """vLLM's structural tag, in either of xgrammar's forms: structures and triggers (its first: free text in
    which each trigger the model writes opens one of the structures whose begin starts with it), or a format
    tree ({"format": ...}, its later one, which newer vLLM builds for tool calling: structural_format.py says
    which node types are served, format_grammar.py how a tree becomes a grammar)."""

    type: Literal["structural_tag"] | None = None  # vLLM's JSON text of it is its response_format's
    structures: list[TagStructure] | None = Field(None, min_length=1, max_length=MAX_TAGS)
    triggers: list[Trigger] | None = Field(None, min_length=1, max_length=MAX_TRIGGERS)
    format: BoundedFormat | None = None

    @model_validator(mode="after")
    def _in_one_form(self):
        _one_form(self.structures, self.triggers, self.format)
        return self


class ResponseFormat(_Request):
    """OpenAI's response_format: free text, any JSON object, or JSON that follows a schema; or vLLM's
    structural tag (either form: StructuralTag)."""

    model_config = STRICT_KEYS
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[TagStructure] | None = Field(None, min_length=1, max_length=MAX_TAGS)
    triggers: list[Trigger] | None = Field(None, min_length=1, max_length=MAX_TRIGGERS)
    format: BoundedFormat | None = None

    @model_validator(mode="after")
    def _fields_with_their_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' goes with type 'json_schema', and only with it")
        if self.type == "structural_tag":
            _one_form(self.structures, self.triggers, self.format)
        elif self.structures is not None or self.triggers is not None or self.format is not None:
            raise ValueError("'structures', 'triggers' and 'format' go with type 'structural_tag', and only "
                             "with it")
        return self


def _json_text(value: Any) -> Any:
    """vLLM's structured_outputs.structural_tag is a JSON text (its response_format's object, dumped): the
    object it holds; an object as it is."""
    if isinstance(value, str):
        try:
            value = loads_finite(value)
        except ValueError as e:
            raise ValueError(f"not a JSON text: {e}") from None
        except RecursionError:  # the body's depth guard (parsing.py) does not see into its strings
            raise ValueError("not a JSON text: nested too deeply") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError("must be an object (format, or structures and triggers) or its JSON text")
    return value


_STRUCTURAL_TAG_TEXT = BeforeValidator(_json_text, json_schema_input_type=str | StructuralTag | None)


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: exactly one constraint on the reply's text."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON schema (or its JSON text)
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)  # the reply is one of these strings
    grammar: str | None = None  # Lark, or llama.cpp's GBNF
    json_object: bool | None = None  # true: any JSON object
    disable_fallback: bool | None = None  # one backend (llguidance): nothing to fall back from
    disable_any_whitespace: Annotated[Any, refused_unless(None, True)] = None  # JSON is compact already
    disable_additional_properties: Annotated[Any, refused_unless(None, False)] = None
    whitespace_pattern: Annotated[Any, refused_unless(None)] = None
    # a structural tag (either form): the object, or its JSON text (vLLM's form)
    structural_tag: Annotated[StructuralTag | None, _STRUCTURAL_TAG_TEXT] = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = self.given()
        if len(given) != 1:
            raise ValueError("give exactly one of 'json', 'regex', 'choice', 'grammar', 'json_object' and "
                             f"'structural_tag' (got {', '.join(given) or 'none'})")
        return self

    def given(self) -> dict[str, Any]:
        """The constraints set, by their JSON names (json_object false asks for nothing)."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        return {name: value for name, value in values.items() if value is not None}


class _SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Annotated[float | None, AfterValidator(_float32_finite)] = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool | None = False
    n: int | None = Field(1, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Annotated[float | None, AfterValidator(_float32_normal)] = Field(None, gt=0.0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None  # declared after `stream`: its validator reads it
    return_token_ids: bool | None = False
    # vLLM's: logprob entries name their tokens "token_id:{id}" (a completion's tokens and top_logprobs keys,
    # chat's token of each entry and of its top_logprobs), so that a token no text spells is still told apart
    return_tokens_as_token_ids: bool | None = False
    # vLLM's: false sends no text ("" in its place); token ids and logprobs still go, and the API process
    # runs no detokenizer for the request. Stop strings and tool calls need the text: a 400 with it
    detokenize: bool | None = True
    user: str | None = None
    add_special_tokens: bool | None = None  # vLLM's; None: True for a prompt, as the template has it in chat
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias in [-100, 100]
    min_tokens: int | None = Field(None, ge=0)  # vLLM's: no EOS, stop token or stop string before this many
    include_stop_str_in_output: bool | None = False  # vLLM's: the stop string ends the text, not cut off
    allowed_token_ids: list[NonNegInt] | None = None  # vLLM's: the only tokens sampled
    # vLLM's: words a choice never completes (server/api/sampling.py encodes them)
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=2**31)  # vLLM's: the prompt's last k tokens
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: each prompt token's logprob + top-k
    skip_special_tokens: bool | None = None  # vLLM's; None: True (the text leaves special tokens out)
    # a structured output (server/api/structured_output.py): at most one of these per request
    response_format: ResponseFormat | None = None  # OpenAI's
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # vLLM's legacy fields: structured_outputs' meanings
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    structural_tag: Annotated[StructuralTag | None, _STRUCTURAL_TAG_TEXT] = None  # vLLM's legacy field too
    guided_whitespace_pattern: Annotated[Any, refused_unless(None)] = None  # as structured_outputs' own
    # vLLM's: the prompt shares prefix-cache blocks only with requests of the same salt (tenants apart: a
    # cached prefix answers faster, which would tell one tenant what another sent)
    cache_salt: Annotated[str | None, AfterValidator(_cache_salt)] = None
    # vLLM's: the client's name for the request, in the response's id and the logs (server/api/request_ids.py)
    request_id: Annotated[str | None, AfterValidator(check_request_id)] = None
    # OpenAI fields pagewalk does not implement: accepted only at their no-op value, never silently ignored
    best_of: int | None = None
    # vLLM's sampling extensions pagewalk does not implement, likewise
    spaces_between_special_tokens: Annotated[Any, refused_unless(None, True)] = None
    use_beam_search: Annotated[Any, refused_unless(None, False)] = None
    length_penalty: Annotated[Any, refused_unless(None, 1.0)] = None
    logits_processors: Annotated[Any, refused_unless(None, [])] = None
    prompt_embeds: Annotated[Any, refused_unless(None)] = None
    priority: Annotated[Any, refused_unless(None, 0)] = None  # vLLM's; admission has no priorities
    kv_transfer_params: Annotated[Any, refused_unless(None, {})] = None  # vLLM's disaggregated prefill
    vllm_xargs: Annotated[Any, refused_unless(None, {})] = None  # vLLM's custom logits processors' arguments

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_when_streaming(cls, v, info: ValidationInfo):
        """vLLM's rule: a stream has no place for them (accepted, they would be dropped)."""
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v):
        """OpenAI's keys are token ids as JSON strings: each a decimal integer (its range is the engine's)."""
        for key in v or ():
            if not (key.isascii() and key.isdecimal() and len(key) <= 10):  # ids < 2**31: 10 digits
                raise ValueError(f"keys must be token ids (decimal integers), got {key!r}")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info: ValidationInfo):
        """best_of = n returns every candidate, which is n; fewer is an error, more (ranking) unsupported."""
        n = info.data.get("n") or 1
        if v is not None and v < n:
            raise ValueError(f"best_of ({v}) must be at least n ({n})")
        if v is not None and v > n:
            raise ValueError("best_of greater than n is not supported by pagewalk (use n)")
        return v

    @property
    def detokenizes(self) -> bool:
        """Whether the choices carry text: detokenize, its default (true) where it is null."""
        return self.detokenize is not False

    @property
    def include_usage(self) -> bool:
        """A usage chunk ends the stream: include_usage, or where it is not given, continuous_usage_stats."""
        so = self.stream_options
        if so is None:
            return False
        return bool(so.continuous_usage_stats if so.include_usage is None else so.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far: continuous_usage_stats, with the usage chunk (an
        explicit include_usage false turns both off, as in vLLM)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


# A completion prompt. Pydantic's smart union spends ~60 us on a 512-id prompt (it weighs every member); left
# to right it takes ~6 us. The request models are strict, so the order decides nothing a smart union would
# decide otherwise (["1", "2"] is no list[int]); str goes first so that a prompt no member takes is reported
# as 'prompt', not as one of its items.
Prompt = Annotated[str | list[int] | list[str] | list[list[int]], Field(union_mode="left_to_right")]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: Annotated[str | None, refused_unless(None, "")] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        """No empty list of ids; an empty text is checked once tokenized (its BOS is a prompt, as vLLM serves
        it: completions._job)."""
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v[0], int | str):  # list[int], one prompt of ids (the union's members are homogeneous):
            return v                     # nothing to scan (a scan of 512 ids cost ~0.2 ms of the API's CPU)
        if any(len(p) == 0 for p in v):
            raise ValueError("prompt must not contain an empty prompt")
        return v


def _template_kwargs(v: dict[str, Any]) -> dict[str, Any]:
    taken = {"messages", "add_generation_prompt"} & set(v)
    if taken:
        raise ValueError(f"{', '.join(sorted(taken))} cannot be set through chat_template_kwargs")
    return v


TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_template_kwargs)]


class ContentPart(_Request):
    type: str
    text: str | None = None
    refusal: str | None = None  # an assistant turn's {"type": "refusal"} part: its text, as vLLM reads it


class ToolCallArgumentsError(ValueError):
    """An earlier turn's tool call whose arguments no prompt can hold."""


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier turn's tool call as templates render it: OpenAI's clients send its arguments as JSON text,
    templates write them with `| tojson`, so they get the value (transformers' convention, as vLLM does);
    arguments that are missing, empty or no JSON (cut) are {} there, as vLLM gives them (Llama 3.1's
    template wrote `"parameters": ""` for them: a review)."""
    function = call.get("function")
    if not isinstance(function, dict):  # (a call without its function: the template says what it lacks)
        return call
    arguments = function.get("arguments")
    if not (arguments is None or isinstance(arguments, str)):
        return call
    try:
        value = loads_finite(arguments or "{}")
    except (ValueError, RecursionError):  # not JSON (NaN included), or nested past Python's stack
        value = {}
    if "\\u" in (arguments or "") and not is_unicode(json.dumps(value, ensure_ascii=False)):  # "\\ud800"
        raise ToolCallArgumentsError("a tool call's function.arguments holds an unpaired UTF-16 surrogate "
                                     "escape (e.g. \"\\ud800\"); strings must be valid Unicode.")
    return {**call, "function": {**function, "arguments": value}}


class ChatMessage(_Request):
    # "ipython": Llama 3's tool results, as its template names them (vLLM takes any role)
    role: Literal["system", "developer", "user", "assistant", "tool", "ipython"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # an earlier turn's function calls and a tool result's id: the chat template renders them (as in vLLM)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        """OpenAI's messages carry content, except an assistant's turn (its tool_calls may stand alone)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: role, content as one string, the optional fields
        that are set."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.tool_calls:  # [] is no calls (LangChain sends it; Llama 3.1's template raised on it)
            out["tool_calls"] = [_call_for_template(call) for call in self.tool_calls]
        return out

    def text(self) -> str:
        """The message content as one string (text parts, and an assistant's refusal parts, concatenated)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type == "text" and part.text is not None:
                texts.append(part.text)
            elif part.type == "refusal" and self.role == "assistant" and part.refusal is not None:
                texts.append(part.refusal)
            elif part.type == "text" or (part.type == "refusal" and self.role == "assistant"):  # no field
                raise ValueError(f"a content part of type '{part.type}' needs its '{part.type}' field")
            else:
                raise ValueError(f"content part of type '{part.type}' is not supported; use 'text' (or "
                                 "'refusal' in an assistant's turn)")
        return "\n".join(texts)  # as vLLM joins a message's text parts for a template of string content


class ToolFunction(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, shown to the model by the chat template
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """tool_choice naming the one function the reply calls."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    # "required" and a named function are served by guided decoding (server/api/forced_tool_calls.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most the first call a reply holds
    functions: Annotated[list[dict[str, Any]] | None, refused_unless(None, [])] = None
    function_call: Annotated[str | dict[str, Any] | None, refused_unless(None, "none", "auto")] = None
    echo: Annotated[bool | None, refused_unless(None, False)] = None  # vLLM's: echo the last message
    audio: Annotated[dict[str, Any] | None, refused_unless(None)] = None
    modalities: Annotated[list[str] | None, refused_unless(None, ["text"])] = None
    prediction: Annotated[dict[str, Any] | None, refused_unless(None)] = None
    web_search_options: Annotated[dict[str, Any] | None, refused_unless(None)] = None
    reasoning_effort: Annotated[str | None, refused_unless(None)] = None
    verbosity: Annotated[str | None, refused_unless(None)] = None
    store: Annotated[bool | None, refused_unless(None, False)] = None  # nothing is stored
    chat_template_kwargs: TemplateKwargs | None = None  # vLLM's: extra template variables
    chat_template: Annotated[Any, refused_unless(None)] = None  # vLLM's per-request template: use the flag
    continue_final_message: Annotated[Any, refused_unless(None, False)] = None
    add_generation_prompt: bool = True  # vLLM's: False renders the messages without the reply's opening
    documents: Annotated[Any, refused_unless(None)] = None

    @model_validator(mode="after")
    def _required_of_no_tools_is_none(self):
        """tool_choice "required" over an empty tools list calls nothing: "none", as vLLM aligns it with
        OpenAI (a review: it was a 400); without a tools list it stays a 400 (forced_tool_calls.py)."""
        if self.tool_choice == "required" and self.tools == []:
            self.tool_choice = "none"
        return self

    @property
    def calls_tools(self) -> bool:
        """Whether the reply may hold tool calls to parse: tools given, tool_choice "auto" (its default)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a completion `prompt` or chat `messages` (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True  # messages only
    chat_template_kwargs: TemplateKwargs | None = None  # messages only
    tools: list[Tool] | None = None  # messages only: rendered as chat renders them
    # None: as the endpoint that takes this input tokenizes it (a prompt gets the post-processor's special
    # tokens, messages what /v1/chat/completions gives them)
    add_special_tokens: bool | None = None
    # vLLM's, not served here (as chat refuses the first two): a 400, never a count of another prompt
    continue_final_message: Annotated[Any, refused_unless(None, False)] = None
    chat_template: Annotated[Any, refused_unless(None)] = None
    return_token_strs: Annotated[Any, refused_unless(None, False)] = None

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[NonNegInt]


# ---- responses -------------------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    """vLLM's Logprob of a prompt position's token: its logprob, vocabulary rank (1: most likely), text."""

    logprob: float
    rank: int
    decoded_token: str | None  # None with detokenize false


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token, keyed by token id; None first


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = Field(**OmitIfNone)
    token_ids: list[int] | None = Field(**OmitIfNone)
    prompt_logprobs: PromptLogprobs | None = Field(**OmitIfNone)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(**OmitIfNone)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = []


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # a JSON object


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class DeltaFunction(BaseModel):
    name: str | None = Field(**OmitIfNone)  # on a call's first delta
    arguments: str  # the whole arguments, or the next piece of them


class DeltaToolCall(BaseModel):
    """A streamed call: whole in one delta (an "auto" one), or (a forced tool_choice's) its id, type and name
    first and then its arguments piece by piece, as OpenAI streams them."""

    index: int  # the call's place in the reply's calls (a streamed delta names it)
    id: str | None = Field(**OmitIfNone)
    type: Literal["function"] | None = Field(**OmitIfNone)
    function: DeltaFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: a reply of tool calls alone
    refusal: str | None = None  # OpenAI's message always carries it (null: the model did not refuse)
    tool_calls: list[ToolCallOut] | None = Field(**OmitIfNone)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(**OmitIfNone)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None  # OpenAI's and vLLM's responses carry it (null here)
    prompt_token_ids: list[int] | None = Field(**OmitIfNone)
    prompt_logprobs: PromptLogprobs | None = Field(**OmitIfNone)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(**OmitIfNone)
    content: str | None = Field(**OmitIfNone)
    tool_calls: list[DeltaToolCall] | None = Field(**OmitIfNone)


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = Field(**OmitIfNone)
    token_ids: list[int] | None = Field(**OmitIfNone)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(**OmitIfNone)
    prompt_token_ids: list[int] | None = Field(**OmitIfNone)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagewalk"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
