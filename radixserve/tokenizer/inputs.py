"""Turning what a client sends (text, token ids or chat messages) into token ids,
within the limits of ``TokenizerConfig`` (checked before the costly work)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from radixserve.sampling_params import SamplingParams, short_repr
from radixserve.structured import check_structured
from radixserve.tokenizer.chat import chat_to_ids
from radixserve.tokenizer.config import TokenizerConfig

_ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_ARGUMENTS_DEPTH = 32  # how deeply a tool call's arguments may nest


class InputProcessor:
    """Validates and tokenizes one prompt. Raises ValueError with a clear message.

    ``context_len`` is the model's context: a prompt must leave room for one
    output token, so it has at most ``context_len - 1`` tokens (or
    ``config.max_prompt_tokens``, when lower).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        config: TokenizerConfig | None = None,
        context_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        self.config = config if config is not None else TokenizerConfig()
        limits = [x for x in (self.config.max_prompt_tokens, context_len and context_len - 1) if x]
        self.max_prompt_tokens = min(limits) if limits else None

    def to_ids(
        self,
        prompt: str | None = None,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        given = [x is not None for x in (prompt, input_ids, messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, input_ids or messages")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:  # a BOS token alone is not a prompt
                raise ValueError("the prompt is empty")
            self._check_chars(len(prompt))
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        elif input_ids is not None:
            ids = self._check_ids(input_ids)
        else:
            ids = self.apply_chat_template(messages)
        if not ids:
            raise ValueError("the prompt is empty")
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

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Messages are ``{role, content}``; an assistant's may carry the tool calls it
        made (``tool_calls``: ``[{id, type, function: {name, arguments}}]``, arguments a
        map or JSON text), a tool's answers one (``tool_call_id``, and ``name``)."""
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        clean = []
        chars = 0
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
        return chat_to_ids(self.tokenizer, clean, self.config.chat_special_tokens)


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
