"""OpenAI's Responses API request bodies (pydantic), and the chat request each becomes.

Types are strict and unknown fields are refused, as on the other routes. ``input`` is
a text (one user message) or a list of items: messages (``role`` user / system /
developer / assistant, content a text or ``input_text`` / ``output_text`` parts),
``function_call`` items (an earlier call of the model) and ``function_call_output``
items (its result). ``instructions`` is the system message; with
``previous_response_id`` the earlier conversation (``responses.ResponseStore``) comes
before the new input, and the earlier instructions do not carry over (as OpenAI's).
Image and file parts are refused with a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from radixserve.http.openai_schema import Int, Number, Schema
from radixserve.http.tools import NO_PARAMETERS, TOOL_NAME_PATTERN


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # an output_text's: only carried back


class InputImage(_Strict):
    """An image of a user message (vision-language models, docs/multimodal.md), by
    ``image_url`` (a data URL, or an allowed file:// or http(s):// one: the chat route's
    ``image_url`` part, its limits and allowed hosts). Uploaded files (``file_id``) are
    not served."""

    type: Literal["input_image"]
    image_url: StrictStr | None = None
    file_id: StrictStr | None = None
    detail: Literal["auto", "low", "high"] | None = None


class InputFile(_Strict):
    """Declared so that a file is a clear 400, not a schema error."""

    type: Literal["input_file"]
    model_config = ConfigDict(strict=True, extra="allow")


Part = Annotated[InputText | InputImage | InputFile, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[Part]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, InputText))

    def unsupported(self) -> str | None:
        """Why this message's parts cannot be served (None: they can)."""
        if isinstance(self.content, str):
            return None
        for p in self.content:
            if isinstance(p, InputFile):
                return "input_file parts are not supported"
            if isinstance(p, InputImage):
                if self.role != "user":
                    return "input_image parts belong to user messages"
                if p.image_url is None or p.file_id is not None:
                    return "an input_image needs an image_url (file_id is not supported)"
        return None

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as the chat route takes it: the text, or parts in order when the
        message holds images."""
        if isinstance(self.content, str) or not any(
            isinstance(p, InputImage) for p in self.content
        ):
            return self.text()
        return [
            {"type": "image_url", "image_url": {"url": p.image_url}}
            if isinstance(p, InputImage)
            else {"type": "text", "text": p.text}
            for p in self.content
            if isinstance(p, InputImage | InputText)
        ]


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


Item = Annotated[
    FunctionCallItem | FunctionCallOutputItem | MessageItem, Field(union_mode="left_to_right")
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME_PATTERN)]
    description: StrictStr | None = None
    parameters: Schema | None = None
    strict: StrictBool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: StrictStr


class TextFormat(_Strict):
    type: Literal["text"]


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``."""

    model: StrictStr
    input: StrictStr | list[Item]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[Int, Field(ge=0)] | None = None  # 0: prefill only
    temperature: Number | None = None
    top_p: Number | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    store: StrictBool = True
    stream: StrictBool = False
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    truncation: Literal["disabled"] | None = None
    text: TextConfig | None = None
    include: Annotated[list[StrictStr], Field(max_length=0)] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # radixserve's extras, as on the chat route
    top_k: Int | None = None
    seed: Int | None = None
    cache_salt: StrictStr | None = None

    def unsupported(self) -> str | None:
        if self.input == [] and self.previous_response_id is None:
            return "input must not be empty"
        if isinstance(self.input, list):
            for item in self.input:
                why = item.unsupported() if isinstance(item, MessageItem) else None
                if why is not None:
                    return why
        return None

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages: each function call joins the assistant message
        before it (or starts one), each output is a ``tool`` message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.chat_content()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": ""})
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return out

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The OpenAI chat body serving this request after the conversation ``history``
        (the earlier response's, or none)."""
        messages = list(history) + self.input_messages()
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        for name in (
            "temperature", "top_p", "top_k", "seed", "cache_salt", "parallel_tool_calls",
            "prompt_cache_key", "prompt_cache_retention",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": t.model_dump(exclude_none=True, exclude={"type"})
                    | ({} if t.parameters is not None else {"parameters": NO_PARAMETERS}),
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        return body
