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
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_MARK = "\ue000rs-content-{}\ue001"  # private-use characters: no tokenizer special token
_MARK_RE = re.compile("\ue000rs-content-(\\d+)\ue001")


def special_token_strings(tokenizer: Any) -> list[str]:
    """The strings this tokenizer parses into special (control) tokens."""
    found = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tok in decoder.values():
        if getattr(tok, "special", False):
            found.add(str(tok))
    return sorted((s for s in found if s), key=len, reverse=True)


def chat_to_ids(
    tokenizer: Any, messages: list[dict[str, Any]], allow_special_tokens: bool = False
) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template, with a
    generation prompt. Special tokens typed in content stay text unless
    ``allow_special_tokens``."""
    specials = special_token_strings(tokenizer)
    typed = [any(s in m["content"] for s in specials) for m in messages]
    if not allow_special_tokens and any(_typed_outside_content(m, specials) for m in messages):
        # Tool calls and ids are rendered by the template itself: no marker can stand
        # for them, so special tokens there are refused.
        raise ValueError(
            "a message's tool calls or tool call id contain special tokens; remove them"
        )
    if allow_special_tokens or not any(typed):
        return _ids(
            tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
    template = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    pieces = _MARK_RE.split(template)  # template text, index, template text, index, ...
    order = [int(i) for i in pieces[1::2]]
    rebuilt = "".join(messages[int(p)]["content"] if k % 2 else p for k, p in enumerate(pieces))
    if order != list(range(len(messages))) or rebuilt != text:
        raise ValueError(
            "a message's content contains special tokens and this model's chat template "
            "does not show content verbatim; remove them from the content"
        )
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            content = messages[int(piece)]["content"]
            ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


def _typed_outside_content(message: Mapping[str, Any], specials: list[str]) -> bool:
    rest = {k: v for k, v in message.items() if k not in ("role", "content")}
    if not rest:
        return False
    text = json.dumps(rest, ensure_ascii=False)
    return any(s in text for s in specials)


def _ids(out: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding, older versions a list.
    if isinstance(out, Mapping) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    assert isinstance(out, Sequence)
    return [int(t) for t in out]
