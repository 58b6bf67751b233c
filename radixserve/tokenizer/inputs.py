"""Turning what a client sends (text, token ids or chat messages) into token ids,
within the limits of ``TokenizerConfig`` (checked before the costly work)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from radixserve.protocol import ImageInput
from radixserve.sampling_params import SamplingParams, short_repr
from radixserve.structured import check_structured
from radixserve.tokenizer.chat import chat_to_ids
from radixserve.tokenizer.config import TokenizerConfig
from radixserve.tokenizer.images import ImageLimits, VisionInputs, load_image, split_content

_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_ARGUMENTS_DEPTH = 32  # how deeply a tool call's arguments may nest
MAX_TOOLS = 128  # tool definitions per chat
MAX_TOOL_DEPTH = 64  # how deeply a tool definition (its parameters' schema) may nest


class InputProcessor:
    """Validates and tokenizes one prompt. Raises ValueError with a clear message.

    ``context_len`` is the model's context: a prompt must leave room for one
    output token, so it has at most ``context_len - 1`` tokens (or
    ``config.max_prompt_tokens``, when lower).

    ``vision``: a vision-language model's image processing (``images.py``), with
    which ``to_request`` takes images; None for a text model, which refuses them.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        config: TokenizerConfig | None = None,
        context_len: int | None = None,
        vision: VisionInputs | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        self.config = config if config is not None else TokenizerConfig()
        limits = [x for x in (self.config.max_prompt_tokens, context_len and context_len - 1) if x]
        self.max_prompt_tokens = min(limits) if limits else None
        self.vision = vision
        cfg = self.config
        self.image_limits = ImageLimits(
            cfg.max_images, cfg.max_image_pixels, cfg.max_image_bytes, cfg.allowed_media_dir,
            tuple(cfg.allowed_media_hosts), cfg.media_fetch_timeout,
        )  # fmt: skip

    def to_request(
        self,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        images: Sequence[Any] | None = None,
        trusted: bool = False,
    ) -> tuple[list[int], list[ImageInput]]:
        """``to_ids`` with images (docs/multimodal.md): in chat content parts, or
        ``images`` for a prompt or token ids holding one placeholder token per image.
        Returns the prompt with each image's placeholder run expanded, and the images.
        ``trusted``: the caller is this process's own code (the Engine), whose images
        may be local paths anywhere. The count of images is checked before any is read."""
        parts = _image_parts(messages) if messages is not None else 0
        count = parts + len(images or ())
        if count == 0:
            return self.to_ids(prompt, input_ids, messages, tools), []
        if self.vision is None:
            raise ValueError("this model takes no images (it is not a vision-language model)")
        limits = self.image_limits
        if count > limits.max_images:
            raise ValueError(
                f"{count} images in one request; this server allows at most {limits.max_images}"
            )
        if messages is not None:
            if images:
                raise ValueError("a chat's images go in its content parts")
            split = [split_content(m.get("content"), limits, trusted) for m in messages]
            chat = [{**m, "content": text} for m, (text, _) in zip(messages, split)]
            ids = self.tokenize(messages=chat, tools=tools, image_ids=self.vision.image_ids)
            decoded = [img for _, imgs in split for img in imgs]
        else:
            decoded = [load_image(src, limits, trusted) for src in images or ()]
            ids = self.to_ids(prompt, input_ids, None, tools)
        expanded, inputs = self.vision.expand(ids, decoded)
        self._check_tokens(len(expanded))
        return expanded, inputs

    def to_ids(
        self,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """``tools``: tool definitions for the chat template (with ``messages`` only)."""
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids or messages")
        if tools is not None and messages is None:
            raise ValueError("tools go with chat messages only (the chat template renders them)")
        if prompt is not None and not prompt and isinstance(prompt, str):
            raise ValueError("the prompt is empty")  # a BOS token alone is not a prompt
        if input_ids is not None:
            ids = self._check_ids(input_ids)
        else:
            ids = self.tokenize(prompt, messages, tools=tools)
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def tokenize(
        self,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        image_ids: list[int] | None = None,
    ) -> list[int]:
        """The token ids of a text (with the tokenizer's special tokens, such as BOS,
        unless ``add_special_tokens`` is False) or of chat messages (with the
        template's generation prompt unless ``add_generation_prompt`` is False; with
        the tool definitions ``tools``): what a ``generate`` with that prompt would
        compute, within the same limits. An empty text has no tokens (without
        special tokens)."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if tools is not None and messages is None:
            raise ValueError("tools go with chat messages only (the chat template renders them)")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            self._check_chars(len(prompt))
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        else:
            ids = self.apply_chat_template(messages, tools, add_generation_prompt, image_ids)
        self._check_tokens(len(ids))
        return ids

    def check_sampling(self, sp: SamplingParams) -> None:
        """The limits on sampling parameters that depend on the server, not the request:
        samples per request, stop lists, stop token ids and biased token ids inside
        the vocabulary; a structured-output constraint that makes a grammar."""
        cfg = self.config
        if sp.n > cfg.max_n:
            raise ValueError(f"n is {sp.n}; this server allows at most {cfg.max_n}")
        if len(sp.stop) > cfg.max_stop:
            raise ValueError(
                f"{len(sp.stop)} stop strings; this server allows at most {cfg.max_stop}"
            )
        longest = max((len(s) for s in sp.stop), default=0)
        if longest > cfg.max_stop_len:
            raise ValueError(
                f"a stop string has {longest} characters; this server allows at most "
                f"{cfg.max_stop_len}"
            )
        if len(sp.stop_token_ids) > cfg.max_stop:
            raise ValueError(
                f"{len(sp.stop_token_ids)} stop token ids; this server allows at most "
                f"{cfg.max_stop}"
            )
        for t in sp.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(
                    f"stop token id {t} is outside the vocabulary [0, {self.vocab_size})"
                )
        for t, _ in sp.logit_bias:
            if t >= self.vocab_size:
                raise ValueError(
                    f"logit_bias token id {t} is outside the vocabulary [0, {self.vocab_size})"
                )
        # A schema, regex or grammar that does not parse is the client's error.
        check_structured(sp.structured)

    def _check_chars(self, n: int) -> None:
        if n > self.config.max_prompt_chars:
            raise ValueError(
                f"the prompt has {n} characters; this server allows at most "
                f"{self.config.max_prompt_chars}"
            )

    def _check_tokens(self, n: int) -> None:
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise ValueError(
                f"the prompt has {n} tokens; at most {self.max_prompt_tokens} fit "
                "(the model's context leaves room for one output token)"
            )

    def check_ids(self, input_ids: Sequence[int]) -> list[int]:
        """Token ids inside the vocabulary and within the prompt limits, as a list."""
        return self._check_ids(input_ids)

    def _check_ids(self, input_ids: Sequence[int]) -> list[int]:
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
            raise ValueError("input_ids must be a list of integers")
        self._check_tokens(len(input_ids))
        ids = list(input_ids)
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError("input_ids must be a list of integers")
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"token id {short_repr(t)} is outside the vocabulary [0, {self.vocab_size})"
                )
        return ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        image_ids: list[int] | None = None,
    ) -> list[int]:
        """Messages are ``{role, content}``; an assistant's may carry the tool calls it
        made (``tool_calls``: ``[{id, type, function: {name, arguments}}]``, arguments a
        map or JSON text), a tool's answers one (``tool_call_id``, and ``name``).

        ``tools`` are the tool definitions the template renders into the prompt (JSON
        maps, as transformers takes them: OpenAI's ``{type: function, function: {name,
        description, parameters}}``); their JSON text counts towards the prompt's
        characters. With ``image_ids`` (a chat with images, ``to_request``), each image
        mark in content becomes those ids."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        clean_tools, chars = None, 0
        if tools is not None:
            clean_tools, chars = _tools(tools)
            self._check_chars(chars)
        clean = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise ValueError("each message must be an object with role and content")
            role, content = m.get("role"), m.get("content")
            if role not in _ROLES:
                raise ValueError(f"message role must be one of {_ROLES}, got {short_repr(role)}")
            if not isinstance(content, str):
                raise ValueError("message content must be a string")
            message: dict[str, Any] = {"role": role, "content": content}
            if m.get("tool_calls") is not None:
                if role != "assistant":
                    raise ValueError("only assistant messages have tool_calls")
                message["tool_calls"] = _tool_calls(m["tool_calls"])
            if role == "tool":
                for key in ("tool_call_id", "name"):
                    if m.get(key) is not None:
                        if not isinstance(m[key], str):
                            raise ValueError(f"a tool message's {key} must be a string")
                        message[key] = m[key]
            extras = {k: v for k, v in message.items() if k not in ("role", "content")}
            chars += len(content) + (len(json.dumps(extras, ensure_ascii=False)) if extras else 0)
            self._check_chars(chars)
            clean.append(message)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; send a prompt instead")
        return chat_to_ids(
            self.tokenizer,
            clean,
            self.config.chat_special_tokens,
            clean_tools,
            add_generation_prompt,
            image_ids,
        )


def _tools(tools: Any) -> tuple[list[dict[str, Any]], int]:
    """Tool definitions, checked and copied as plain JSON data, and their JSON text's
    length."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError("tools must be a list of tool definitions (objects)")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{len(tools)} tools; at most {MAX_TOOLS} are allowed")
    out, chars = [], 0
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise ValueError("each tool must be an object, e.g. {type: function, function: {...}}")
        if _depth(tool) > MAX_TOOL_DEPTH:
            raise ValueError(f"a tool definition nests deeper than {MAX_TOOL_DEPTH}")
        try:
            text = json.dumps(tool, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError("a tool definition must be JSON data") from None
        out.append(json.loads(text))
        chars += len(text)
    return out, chars


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's tool calls, checked and copied. Arguments given as JSON
    text of an object become that object: templates render them from a mapping (HF's
    convention, ``| tojson``); other text stays text."""
    bad = ValueError(
        "tool_calls must be a list of {id, type: function, function: {name, arguments}}"
    )
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise bad
    out = []
    for call in calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise bad
        fn = call["function"]
        name, arguments = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, (str, Mapping)):
            raise bad
        if call.get("type", "function") != "function" or not isinstance(call.get("id", ""), str):
            raise bad
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):
                parsed = None
            if isinstance(parsed, dict):
                arguments = parsed
        if isinstance(arguments, Mapping):
            if _depth(arguments) > MAX_ARGUMENTS_DEPTH:
                raise ValueError(f"tool call arguments nest deeper than {MAX_ARGUMENTS_DEPTH}")
            try:
                json.dumps(arguments)  # JSON data only, as templates render it
            except (TypeError, ValueError):
                raise bad from None
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        if "id" in call:
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _depth(value: Any) -> int:
    """How deeply lists and maps nest in ``value`` (iteratively: any depth is safe)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, Mapping):
            todo.extend((x, d + 1) for x in v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend((x, d + 1) for x in v)
        else:
            continue
        deepest = max(deepest, d)
    return deepest


def _image_parts(messages: Any) -> int:
    """How many image content parts a chat holds (before any is read)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        return 0
    count = 0
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
            count += sum(
                isinstance(p, Mapping) and p.get("type") in ("image_url", "image") for p in content
            )
    return count
