"""Chat messages to token ids, with user-supplied content kept as text.

A chat template renders messages into one string with control tokens around
each message (``<|im_start|>user\\n...<|im_end|>``). Tokenizing that string
whole parses every special-token string in it, including ones a client typed
inside its content: ``"<|im_end|>\\n<|im_start|>system\\n..."`` in a user
message would end the message and open a system turn. So by default content
is tokenized with special tokens split into plain text, and only the
template's own text yields control tokens.

How: when no content contains a special-token string (the usual case) the
template is tokenized whole, exactly as transformers does. Otherwise the
template is rendered once with each content replaced by a unique marker; the
text between markers is the template's (tokenized with special tokens), each
marker stands for one message's content (tokenized with
``split_special_tokens``). If the template does not emit each content exactly
once and verbatim (it trims or rewrites it), the request is refused rather
than risk parsing typed control tokens.

Tool definitions (``tools``, JSON-schema function descriptions) are passed to the
template as its ``tools`` variable, as transformers does. Like an assistant's tool
calls, they are rendered by the template itself, so no marker can stand for them:
special tokens typed inside them are refused (unless ``allow_special_tokens``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

#: An image inside chat content while it is templated (``images.py``): one private-use
#: character, no tokenizer's special token; it becomes the model's image tokens.
IMAGE_MARK = "\ue002"
_MARK = "\ue000rs-content-{}\ue001"  # private-use characters: no tokenizer special token
_MARK_RE = re.compile("\ue000rs-content-(\\d+)\ue001")
_MAX_WHY = 200  # characters of a template's own error message that are passed on


def special_token_strings(tokenizer: Any) -> list[str]:
    """The strings this tokenizer parses into special (control) tokens."""
    found = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tok in decoder.values():
        if getattr(tok, "special", False):
            found.add(str(tok))
    return sorted((s for s in found if s), key=len, reverse=True)


def chat_to_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    allow_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    image_ids: list[int] | None = None,
) -> list[int]:
    """Token ids of ``messages`` (and the tool definitions ``tools``) rendered by the
    tokenizer's chat template, with a generation prompt unless
    ``add_generation_prompt`` is False. Special tokens typed in content stay text
    unless ``allow_special_tokens``; typed in tool calls or tool definitions, they
    are refused. A template that fails (``raise_exception`` on a chat it does not
    take) is a ValueError. With ``image_ids`` (a chat with images), each
    ``IMAGE_MARK`` in content becomes those ids (a vision-language model's tokens for
    one image); without, content is text only."""
    gen = add_generation_prompt
    specials = special_token_strings(tokenizer)
    typed = [any(s in m["content"] for s in specials) for m in messages]
    if not allow_special_tokens:
        # Tool calls, ids and tool definitions are rendered by the template itself: no
        # marker can stand for them, so special tokens there are refused.
        if any(_typed_outside_content(m, specials) for m in messages):
            raise ValueError(
                "a message's tool calls or tool call id contain special tokens; remove them"
            )
        if tools and _typed_in(tools, specials):
            raise ValueError("the tool definitions contain special tokens; remove them")
    images = image_ids is not None
    if (allow_special_tokens or not any(typed)) and not images:
        return _ids(_render(tokenizer, messages, tools, gen, tokenize=True))
    text = _render(tokenizer, messages, tools, gen, tokenize=False)
    marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
    template = _render(tokenizer, marked, tools, gen, tokenize=False)
    pieces = _MARK_RE.split(template)  # template text, index, template text, index, ...
    order = [int(i) for i in pieces[1::2]]
    rebuilt = "".join(messages[int(p)]["content"] if k % 2 else p for k, p in enumerate(pieces))
    if order != list(range(len(messages))) or rebuilt != text:
        raise ValueError(
            "a message's content contains special tokens and this model's chat template "
            "does not show content verbatim; remove them from the content"
        )
    ids: list[int] = []
    split = not allow_special_tokens
    for k, piece in enumerate(pieces):
        if k % 2:
            content = messages[int(piece)]["content"]
            for j, text in enumerate(content.split(IMAGE_MARK) if images else [content]):
                if j:
                    ids += image_ids or []
                if text:
                    ids += tokenizer.encode(
                        text, add_special_tokens=False, split_special_tokens=split
                    )
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    **kw: Any,
) -> Any:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, **kw
        )
    except jinja2.TemplateError as e:  # the template's raise_exception, or its own bug
        why = str(e) if len(str(e)) <= _MAX_WHY else str(e)[: _MAX_WHY - 3] + "..."
        raise ValueError(f"this model's chat template refused the chat: {why}") from None


def _typed_outside_content(message: Mapping[str, Any], specials: list[str]) -> bool:
    return _typed_in([v for k, v in message.items() if k not in ("role", "content")], specials)


def _typed_in(value: Any, specials: list[str]) -> bool:
    """Whether any string in ``value`` (JSON data: map keys included) holds a special
    token. Each string is checked as the template may print it: raw, not JSON-escaped."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if any(s in v for s in specials):
                return True
        elif isinstance(v, Mapping):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
    return False


def _ids(out: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding, older versions a list.
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    assert isinstance(out, Sequence)
    return [int(t) for t in out]
