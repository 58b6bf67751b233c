"""Anthropic's Messages API request bodies (pydantic), and what each becomes: the chat
request the rest of the front already serves (``openai_schema.ChatCompletionRequest``).

Types are strict and unknown fields are refused, as on the OpenAI routes, so a
misspelt parameter is a 400 naming it. A Messages request maps onto chat messages:

* ``system`` (a string or text blocks) is the system message;
* a user turn's ``tool_result`` blocks are ``tool`` messages (answering the call they
  name), its text blocks one user message after them;
* an assistant turn's text is its content and its ``tool_use`` blocks its
  ``tool_calls`` (``input`` as JSON text);
* ``tools`` are function tools, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none``
  OpenAI's ``auto`` / ``required`` / named function / ``none``, ``stop_sequences`` is
  ``stop``.

Image and document blocks are refused with a 400: this server's models read text only.

``cache_control`` (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) on a system block, a
message block or a tool is a breakpoint: the request asks that its cached prefix be
kept for the longest TTL it names (``retention()``, docs/agents.md).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from radixserve.http.cache_steering import retention_hint
from radixserve.http.openai_schema import Int, Number
from radixserve.http.tools import TOOL_NAME_PATTERN

#: Seconds each ``cache_control`` TTL keeps a prefix.
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
DOCUMENTS_REFUSED = "documents are not supported by this model"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None  # only null / [] (no citation is produced)


#: The image types an Anthropic ``base64`` image source may name.
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class ImageBlock(_Strict):
    """An image of a user turn (vision-language models, docs/multimodal.md): its
    ``source`` a ``base64`` one (``media_type``, ``data``) or a ``url`` one, served as
    the chat route's ``image_url`` part (which applies the image limits and the
    allowed hosts). Refused inside a ``tool_result``."""

    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None

    def url(self) -> str:
        """The image as a URL the chat route takes; ValueError for a bad source."""
        src = self.source
        kind = src.get("type")
        if kind == "base64":
            media, data = src.get("media_type"), src.get("data")
            if media not in IMAGE_MEDIA_TYPES:
                raise ValueError(f"an image's media_type must be one of {list(IMAGE_MEDIA_TYPES)}")
            if not isinstance(data, str) or set(src) - {"type", "media_type", "data"}:
                raise ValueError("a base64 image source has media_type and data (a string)")
            return f"data:{media};base64,{data}"
        if kind == "url":
            url = src.get("url")
            if not isinstance(url, str) or set(src) - {"type", "url"}:
                raise ValueError("a url image source has url (a string)")
            return url
        raise ValueError('an image source is {"type": "base64", ...} or {"type": "url", ...}')


class DocumentBlock(_Strict):
    type: Literal["document"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None
    title: StrictStr | None = None
    context: StrictStr | None = None
    citations: dict[str, Any] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[ResultPart] = ""
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        # An image part is refused before this (MessagesRequest.unsupported).
        return "".join(part.text for part in self.content if isinstance(part, TextBlock))


Block = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]

    def blocks(self) -> list[Any]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class ToolParam(_Strict):
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME_PATTERN)]
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Metadata(_Strict):
    user_id: StrictStr | None = None  # the caller's bookkeeping; no effect


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


class MessagesRequest(_Strict):
    """``POST /v1/messages``."""

    model: StrictStr
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    max_tokens: Annotated[Int, Field(ge=1)]
    system: StrictStr | list[TextBlock] | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    thinking: ThinkingDisabled | None = None  # extended thinking is not served
    # radixserve's extras, as on the OpenAI routes
    seed: Int | None = None
    cache_salt: StrictStr | None = None

    def unsupported(self) -> str | None:
        """Why the request asks for something this server cannot do (None: it doesn't)."""
        choice = self.tool_choice
        if choice is not None and (choice.type == "tool") != (choice.name is not None):
            return 'tool_choice needs a name with type "tool", and only then'
        for m in self.messages:
            for b in m.blocks():
                if isinstance(b, ImageBlock):
                    if m.role == "assistant":
                        return "image blocks belong to user turns"
                    try:
                        b.url()
                    except ValueError as e:
                        return str(e)
                if (
                    isinstance(b, ToolResultBlock)
                    and not isinstance(b.content, str)
                    and any(isinstance(p, ImageBlock) for p in b.content)
                ):
                    return (
                        "images inside a tool_result are not supported: put them in the user turn"
                    )
                if isinstance(b, DocumentBlock):
                    return DOCUMENTS_REFUSED
                if isinstance(b, TextBlock) and b.citations:
                    return "citations are not supported"
                if m.role == "user" and isinstance(b, ToolUseBlock):
                    return "tool_use blocks belong to assistant turns"
                if m.role == "assistant" and isinstance(b, ToolResultBlock):
                    return "tool_result blocks belong to user turns"
        return None

    # ------------------------------------------------------------ the chat request
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(b.text for b in self.system)

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI chat messages (call after ``unsupported()``)."""
        out: list[dict[str, Any]] = []
        system = self.system_text()
        if system:
            out.append({"role": "system", "content": system})
        for m in self.messages:
            blocks = m.blocks()
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            if m.role == "assistant":
                calls = [
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": json.dumps(b.input)},
                    }
                    for b in blocks
                    if isinstance(b, ToolUseBlock)
                ]
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if calls:
                    message["tool_calls"] = calls
                out.append(message)
                continue
            for b in blocks:
                if isinstance(b, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            if any(isinstance(b, ImageBlock) for b in blocks):  # parts, in block order
                parts = [
                    {"type": "image_url", "image_url": {"url": b.url()}}
                    if isinstance(b, ImageBlock)
                    else {"type": "text", "text": b.text}
                    for b in blocks
                    if isinstance(b, ImageBlock | TextBlock)
                ]
                out.append({"role": "user", "content": parts})
            elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": text})
        return out

    def chat_body(self) -> dict[str, Any]:
        """The OpenAI chat body serving this request (``ChatCompletionRequest``'s fields)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.chat_messages(),
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }
        for name in ("temperature", "top_p", "top_k", "seed", "cache_salt"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.stop_sequences:
            body["stop"] = list(self.stop_sequences)
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        **({"description": t.description} if t.description else {}),
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool":
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
            if choice.disable_parallel_tool_use is not None and self.tools:
                body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        seconds = self.retention_seconds()
        if seconds is not None:
            body["cache_retention"] = retention_hint(seconds)
        return body

    # ------------------------------------------------------------ cache breakpoints
    def breakpoints(self) -> list[CacheControl]:
        """Every ``cache_control`` the request gives, in prompt order."""
        found = [t.cache_control for t in self.tools or ()]
        if isinstance(self.system, list):
            found += [b.cache_control for b in self.system]
        for m in self.messages:
            found += [getattr(b, "cache_control", None) for b in m.blocks()]
        return [c for c in found if c is not None]

    def retention_seconds(self) -> float | None:
        """How long the prompt's cached prefix is asked to stay: the longest TTL of its
        breakpoints (None: no breakpoint)."""
        ttls = [TTL_SECONDS[c.ttl] for c in self.breakpoints()]
        return max(ttls) if ttls else None


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``: the fields that shape the prompt."""

    model: StrictStr
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingDisabled | None = None

    def as_messages_request(self) -> MessagesRequest:
        fields = self.model_dump(exclude_none=True)
        return MessagesRequest.model_validate({**fields, "max_tokens": 1})
