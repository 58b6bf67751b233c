"""Structured output: from a ``StructuredOutput`` to an xgrammar grammar.

Shared by the front (the tokenizer process and the Engine check every
constraint before anything is scheduled, so a bad schema, regex or grammar is
the client's error) and the worker (which compiles it against the model's
vocabulary, ``worker/grammar.py``). See docs/structured.md.

JSON is generated compactly, in the form ``{"a": 1, "b": [true, null]}``: one
space after ``:`` and ``,``, no other whitespace (xgrammar's
``any_whitespace=False``). That is what makes separators and keys constant
strings the grammar forces, and so what jump-forward decoding skips.
``json_schema`` follows xgrammar's strict mode (properties and items not in
the schema are not generated, as OpenAI's ``strict: true``); ``json_object``
is any JSON object.

Imports no torch; xgrammar is imported on first use.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from radixserve.sampling_params import StructuredOutput

JSON_SEPARATORS = (", ", ": ")
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: ": not for a client.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_CHECKED_LIMIT = 256  # sources the front remembers as valid


def xgrammar() -> Any:
    """The xgrammar module, or an ImportError saying how to get it."""
    try:
        import xgrammar as xgr
    except ImportError as e:  # pragma: no cover - it is a dependency
        raise ImportError(f"structured output needs xgrammar (pip install xgrammar): {e}") from None
    return xgr


def clean_error(e: BaseException) -> str:
    """xgrammar's message without its log prefix, on one line."""
    text = str(e).strip()
    text = _LOG_PREFIX.sub("", text)
    return " ".join(text.split()) or type(e).__name__


def build_grammar(so: StructuredOutput) -> Any:
    """The ``xgrammar.Grammar`` for ``so``; ValueError naming the problem if it has one."""
    xgr = xgrammar()
    so.validate()
    try:
        if so.kind in ("json_schema", "json_object"):
            schema = so.spec if so.kind == "json_schema" else '{"type": "object"}'
            grammar = xgr.Grammar.from_json_schema(
                schema,
                any_whitespace=False,
                separators=JSON_SEPARATORS,
                strict_mode=so.kind == "json_schema",
            )
            return _escape_control_characters(xgr, grammar)
        if so.kind == "regex":
            return xgr.Grammar.from_regex(so.spec)
        return xgr.Grammar.from_ebnf(so.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"invalid {_NAMES[so.kind]}: {clean_error(e)}") from None


# xgrammar (0.2.9) writes a length-bounded string's characters as any character
# but quote, backslash, CR and LF: raw control characters, which JSON forbids
# inside strings, pass. Its unbounded strings exclude U+0000..U+001F; bounded
# ones are given the same class.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _escape_control_characters(xgr: Any, grammar: Any) -> Any:
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regex",
    "grammar": "grammar",
}

_checked: OrderedDict[str, None] = OrderedDict()
_checked_lock = threading.Lock()


def check_structured(so: StructuredOutput | None) -> None:
    """Raise ValueError when ``so`` does not make a grammar (a few recent valid
    sources are remembered, so a repeated schema is parsed once)."""
    if so is None:
        return
    key = so.key
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            return
    build_grammar(so)
    with _checked_lock:
        _checked[key] = None
        while len(_checked) > _CHECKED_LIMIT:
            _checked.popitem(last=False)
