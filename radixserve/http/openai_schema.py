"""OpenAI request bodies (pydantic) and what each becomes: sampling parameters and prompts.

Types are strict (``"5"`` is not an integer, ``1`` is not a boolean), integers
fit int64 (token ids int32), and unknown fields are refused, so a misspelt or unsupported parameter is a 400 naming it
instead of a silently different completion. Fields OpenAI defines that this
server cannot honour are declared here only to refuse them with a message
(``unsupported()``); ``user`` is accepted because it never changes the output.
docs/http.md lists every field with its semantics.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from radixserve.sampling_params import INT64_MAX, TOKEN_ID_MAX, SamplingParams

# Integers travel to the server as msgpack int64 and token ids as int32: larger ones
# are a 400 naming the field here, never an encoding failure further on.
Int = Annotated[StrictInt, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
TokenId = Annotated[StrictInt, Field(ge=0, le=TOKEN_ID_MAX)]
Number = Int | StrictFloat
TokenIds = list[TokenId]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields both endpoints share: the sampling parameters and radixserve's extras."""

    model_config = ConfigDict(strict=True, extra="forbid")

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
    min_tokens: Int | None = None
    stop_token_ids: list[TokenId] | None = None

    def unsupported(self) -> str | None:
        """Why this request asks for something the server cannot do (None: it doesn't)."""
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream=true"
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
            "logit_bias",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.stop is not None:
            fields["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        fields["ignore_eos"] = self.ignore_eos
        return SamplingParams(**fields, **self._logprob_fields())

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


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: Int | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs=true"
        if self.tools or self.tool_choice not in (None, "none"):
            return "tools are not supported"
        if self.response_format not in (None, {"type": "text"}):
            return "response_format is not supported (only {'type': 'text'})"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "give max_completion_tokens or max_tokens, not both"
        return super().unsupported()

    def _logprob_fields(self) -> dict[str, Any]:
        if not self.logprobs:
            return {}
        return {"logprobs": self.top_logprobs or 0}

    def messages_as_dicts(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]

    @property
    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
