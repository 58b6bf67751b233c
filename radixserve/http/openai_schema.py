"""OpenAI request bodies (pydantic) and what each becomes: sampling parameters and prompts.

Types are strict (``"5"`` is not an integer, ``1`` is not a boolean), integers
fit int64 (token ids int32), and unknown fields are refused, so a misspelt or unsupported parameter is a 400 naming it
instead of a silently different completion. Fields OpenAI defines that this
server cannot honour are declared here only to refuse them with a message
(``unsupported()``); ``user`` is accepted because it never changes the output.
docs/http.md lists every field with its semantics.

A completion's output may be constrained (docs/structured.md) by one of: OpenAI's
``response_format``, SGLang's ``regex`` and ``ebnf``, vLLM's ``structured_outputs``
and its older ``guided_*`` fields, and (chat) ``tools`` with a ``tool_choice`` that
makes the model call one (``tools.py``). A request giving more than one is refused.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from radixserve.http.cache_steering import PROMPT_CACHE_RETENTION, retention_hint
from radixserve.http.tool_parsers import AutoToolCalling
from radixserve.http.tools import NO_PARAMETERS, TOOL_NAME_PATTERN, ToolCalling
from radixserve.sampling_params import (
    INT64_MAX,
    TOKEN_ID_MAX,
    SamplingParams,
    StructuredOutput,
    short_repr,
)

# Integers travel to the server as msgpack int64 and token ids as int32: larger ones
# are a 400 naming the field here, never an encoding failure further on.
Int = Annotated[StrictInt, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
TokenId = Annotated[StrictInt, Field(ge=0, le=TOKEN_ID_MAX)]
Number = Int | StrictFloat
TokenIds = list[TokenId]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


# A JSON schema: an object, or true / false (any value / none).
Schema = dict[str, Any] | StrictBool


class JsonSchemaSpec(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    schema_: Schema = Field(alias="schema")
    # Output always follows the schema strictly (as OpenAI's strict: true), either way.
    strict: StrictBool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


_REGEX_META = re.compile(r"[\\^$.|?*+()\[\]{}/]")


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices``, each taken literally."""
    return "(" + "|".join(_REGEX_META.sub(r"\\\g<0>", c) for c in choices) + ")"


# vLLM's kinds of constraint, and the request fields giving one (SGLang's, vLLM's older).
_KINDS = {
    "json": StructuredOutput.json,
    "regex": StructuredOutput.regex,
    "choice": lambda choices: StructuredOutput.regex(choice_regex(choices)),
    "grammar": StructuredOutput.grammar,
}
_FIELD_KINDS = {
    "regex": "regex",
    "ebnf": "grammar",
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_choice": "choice",
}
Choices = Annotated[list[StrictStr], Field(min_length=1)]


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: one of its fields."""

    json_: Schema | StrictStr | None = Field(None, alias="json")  # a schema or its JSON text
    regex: StrictStr | None = None
    choice: Choices | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    def constraints(self) -> dict[str, StructuredOutput]:
        values = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
        }
        found = {k: _KINDS[k](v) for k, v in values.items() if v is not None}
        if self.json_object:
            found["json_object"] = StructuredOutput.json_object()
        if not found:
            raise ValueError(f"structured_outputs needs one of {', '.join(values)}, json_object")
        return found


class _Common(_Strict):
    """Fields both endpoints share: the sampling parameters and radixserve's extras."""

    model: StrictStr
    temperature: Number | None = None
    top_p: Number | None = None
    n: Int = 1
    stop: StrictStr | list[StrictStr] | None = None
    seed: Int | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # an end-user id for the caller's bookkeeping; no effect
    # radixserve (and vLLM) extras
    top_k: Int | None = None
    min_p: Number | None = None
    ignore_eos: StrictBool = False
    cache_salt: StrictStr | None = None
    # vLLM's extension: each choice (and each streamed delta) also carries its token ids
    return_token_ids: StrictBool = False
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    # vLLM's sampling extras
    repetition_penalty: Number | None = None
    priority: Int | None = None  # vLLM's: lower first (docs/scheduler.md, "Priorities")
    request_timeout: Number | None = None  # seconds the server gives the request
    cache_retention: tuple[Int, Number] | None = None  # [level, seconds]: keep the prompt
    # OpenAI's cache steering (cache_steering.py): a routing key, never a namespace;
    # how long the prompt's cached prefix is kept.
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    explain: StrictBool | None = None  # usage.explain: the cache's hit explained
    # vLLM's and SGLang's text options, which SGLang's gateway sends with every request:
    # accepted at the only values radixserve serves (special tokens skipped and joined
    # without spaces, the text ending before a matched stop string, no hidden states).
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    return_hidden_states: StrictBool | None = None
    min_tokens: Int | None = None
    stop_token_ids: list[TokenId] | None = None
    # Output constraints, one at most: OpenAI's, SGLang's extras, vLLM's extras.
    response_format: ResponseFormat | None = None
    regex: StrictStr | None = None
    ebnf: StrictStr | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_grammar: StrictStr | None = None
    guided_choice: Choices | None = None

    def unsupported(self) -> str | None:
        """Why this request asks for something the server cannot do (None: it doesn't)."""
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream=true"
        for name, served in (("skip_special_tokens", True), ("spaces_between_special_tokens", True),
                             ("no_stop_trim", False), ("return_hidden_states", False)):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value != served:
                return f"{name}={str(value).lower()} is not supported"
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for this request (ValueError names a bad value)."""
        fields: dict[str, Any] = {"max_tokens": max_tokens, "n": self.n}
        for name in (
            "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids",
            "logit_bias", "priority", "request_timeout", "cache_retention", "explain",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.prompt_cache_retention is not None and self.cache_retention is None:
            seconds = PROMPT_CACHE_RETENTION[self.prompt_cache_retention]
            fields["cache_retention"] = retention_hint(seconds)
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        fields["ignore_eos"] = self.ignore_eos
        return SamplingParams(**fields, **self._logprob_fields(), structured=self.structured())

    def constraints(self) -> dict[str, StructuredOutput]:
        """Each output constraint this request gives, by the field that gives it."""
        found: dict[str, StructuredOutput] = {}
        rf = self.response_format
        if isinstance(rf, JsonObjectFormat):
            found["response_format"] = StructuredOutput.json_object()
        elif isinstance(rf, JsonSchemaFormat):
            found["response_format"] = StructuredOutput.json(rf.json_schema.schema_)
        for name, kind in _FIELD_KINDS.items():
            value = getattr(self, name)
            if value is not None:
                found[name] = _KINDS[kind](value)
        if self.structured_outputs is not None:
            given = self.structured_outputs.constraints()
            found.update({f"structured_outputs.{k}": v for k, v in given.items()})
        return found

    def structured(self) -> StructuredOutput | None:
        """The request's one output constraint, if any (ValueError: more than one)."""
        found = self.constraints()
        if len(found) > 1:
            raise ValueError(
                f"give at most one output constraint; this request gives {len(found)}: "
                + ", ".join(found)
            )
        return next(iter(found.values()), None)

    def _logprob_fields(self) -> dict[str, Any]:
        return {}


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: Int | None = 16  # OpenAI's default for completions
    logprobs: Int | None = None
    echo: StrictBool = False
    best_of: Int | None = None
    suffix: StrictStr | None = None
    # radixserve's extra (SGLang's name): with echo and logprobs, score the prompt from
    # this token on; the tokens before it may come from the prefix cache.
    logprob_start_len: Int | None = None

    def unsupported(self) -> str | None:
        if self.logprob_start_len is not None and not (self.echo and self.logprobs is not None):
            return "logprob_start_len needs echo=true and logprobs"
        if self.best_of not in (None, self.n):
            return "best_of is not supported (use n)"
        if self.suffix:
            return "suffix is not supported"
        return super().unsupported()

    def _logprob_fields(self) -> dict[str, Any]:
        # echo with logprobs scores the whole prompt too (OpenAI's shape: the first
        # token has no logprob).
        if self.logprobs is None:
            return {}
        if self.echo:
            start = (
                {}
                if self.logprob_start_len is None
                else {"logprob_start_len": self.logprob_start_len}
            )
            return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs, **start}
        return {"logprobs": self.logprobs}

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: one text or token list each (OpenAI allows a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(_Strict):
    url: StrictStr  # data:image/...;base64, or an allowed file:// or http(s):// URL
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    """An image in a chat message (vision-language models, docs/multimodal.md)."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionDef(_Strict):
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME_PATTERN)]
    description: StrictStr | None = None
    parameters: Schema | None = None  # none: the function takes no arguments
    strict: StrictBool | None = None  # calls always follow parameters strictly


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI returns it


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool message answers this call

    @model_validator(mode="after")
    def _fits_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id; other messages have none")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (an assistant message may give tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def _content(self) -> str | list[dict[str, Any]]:
        """The content as the tokenizer takes it: text, or with images its parts."""
        if isinstance(self.content, list) and any(isinstance(p, ImagePart) for p in self.content):
            return [p.model_dump(exclude_none=True) for p in self.content]
        return self.text()

    def as_dict(self) -> dict[str, Any]:
        """The message as the tokenizer takes it (docs/protocol.md)."""
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        out: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self._content(),
        }
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": c.function.arguments,
                    },
                }
                for c in self.tool_calls
            ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                out["name"] = self.name
        return out


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: Int | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # A constrained choice makes one call: what false asks, and what true allows; "auto"
    # keeps every call the model writes unless this is false.
    parallel_tool_calls: StrictBool | None = None

    def unsupported(self, tool_parser: str | None = None) -> str | None:
        """``tool_parser``: the server's ``--tool-call-parser`` (which makes "auto" work)."""
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs=true"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "give max_completion_tokens or max_tokens, not both"
        return self._tools_unsupported(tool_parser) or super().unsupported()

    def _tools_unsupported(self, tool_parser: str | None) -> str | None:
        choice = self.tool_choice
        if not self.tools:
            if choice in (None, "none", "auto"):
                return None
            return "tool_choice needs tools"
        names = [t.function.name for t in self.tools]
        if len(set(names)) < len(names):
            return "tools must have distinct function names"
        if choice in (None, "auto") and tool_parser is None:
            return (
                'tool_choice "auto" (the default when tools are given) is not supported: '
                "telling a tool call from text needs a parser for the model's tool-call "
                "format, which this server was not started with (--tool-call-parser). "
                'Use tool_choice "required" or {"type": "function", "function": '
                '{"name": ...}}, which constrain the output to a call, or "none"'
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return (
                f"tool_choice names the function {short_repr(choice.function.name)}, "
                "which is not among tools"
            )
        return None

    def tool_calling(self) -> ToolCalling | None:
        """How each choice becomes a tool call; None when tools play no part."""
        choice = self.tool_choice
        if not self.tools or not (choice == "required" or isinstance(choice, NamedToolChoice)):
            return None
        parameters = {
            t.function.name: NO_PARAMETERS
            if t.function.parameters is None
            else t.function.parameters
            for t in self.tools
        }
        if isinstance(choice, NamedToolChoice):
            return ToolCalling.named(choice.function.name, parameters[choice.function.name])
        return ToolCalling.required(parameters)

    def auto_calling(self, tool_parser: str | None) -> AutoToolCalling | None:
        """With tools and tool_choice "auto" (or none given) on a server with a tool-call
        parser: the output stays free and is read into calls (tool_parsers.py)."""
        if not self.tools or self.tool_choice not in (None, "auto") or tool_parser is None:
            return None
        parameters = {t.function.name: t.function.parameters for t in self.tools}
        return AutoToolCalling(tool_parser, parameters, self.parallel_tool_calls is not False)

    def constraints(self) -> dict[str, StructuredOutput]:
        found = super().constraints()
        calling = self.tool_calling()
        if calling is not None:
            found["tool_choice"] = calling.structured
        return found

    def _logprob_fields(self) -> dict[str, Any]:
        if not self.logprobs:
            return {}
        return {"logprobs": self.top_logprobs or 0}

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def tools_as_dicts(self) -> list[dict[str, Any]] | None:
        """The tool definitions as the chat template gets them, whatever tool_choice is
        (as vLLM does): OpenAI's ``{type: function, function: {...}}`` without unset
        fields; a function without parameters shows the empty parameter list its calls
        are constrained to."""
        if not self.tools:
            return None
        out = []
        for t in self.tools:
            function = t.function.model_dump(exclude_none=True)
            function.setdefault("parameters", NO_PARAMETERS)
            out.append({"type": "function", "function": function})
        return out

    @property
    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
