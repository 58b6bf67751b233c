"""The cache's explain and the dashboard's tree, as text: the scheduler answers in
token ids (``scheduler/explain.py``, ``scheduler/monitor.py``); the tokenizer process
and the Engine write the text here, and a sentence saying why the hit stops.

``render_explain(decode, report)`` adds, to the report's miss, ``text_before`` and
``text_after`` (the prompt around the first miss) and the most common continuation's
``text``, and ``reason``: one sentence. ``render_dashboard(decode, data)`` writes each
tree node's ``label`` (the first words of its edge). ``decode(ids)`` is the
tokenizer's decode (special tokens kept: a chat template's markers say where a turn
starts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

_REASONS = {
    "no_cache": "the server runs without a prefix cache (--cache none)",
    "empty_namespace": "nothing is cached in this namespace (cache salt and adapter) yet",
    "last_token": (
        "everything that can be reused is reused: at most {limit} tokens of this prompt "
        "can come from the cache (whole pages of {page_size} tokens, before the last "
        "prompt token, whose logits give the first output token)"
    ),
    "snapshot": (
        "the model has recurrent layers: a hit must end where a state snapshot was "
        "saved, and the last snapshot on this path is at token {hit}; the tree holds "
        "the KV up to token {kv_tokens}"
    ),
    "window": (
        "the model has sliding-window layers: their window pages were not all kept "
        "past token {hit} (the KV is cached up to token {kv_tokens})"
    ),
    "partial_page": (
        "the prompt agrees with the cache up to token {agreed_tokens}, but only whole "
        "pages are shared: the hit ends at the page boundary {hit}"
    ),
    "diverged": "token {position} differs from every cached continuation",
    "end_of_cache": "nothing cached goes on past token {position}",
}


def reason(report: dict) -> str:
    """One sentence: why the hit stops where it does."""
    miss = report.get("miss") or {}
    ps = report["page_size"]
    fields = {
        "limit": report["match_limit"] - report["match_limit"] % ps,
        "page_size": ps,
        "hit": report["hit_tokens"],
        "kv_tokens": report["kv_tokens"],
        "agreed_tokens": report["agreed_tokens"],
        "position": miss.get("position", report["hit_tokens"]),
    }
    text = _REASONS[report["stop"]].format(**fields)
    evicted = miss.get("evicted")
    if evicted:
        text += (
            f"; a cached match of at least {evicted['tokens']} tokens was evicted "
            f"{evicted['seconds_ago']:.1f} s ago"
        )
    return text[0].upper() + text[1:] + "."


def render_explain(decode: Decode, report: dict) -> dict:
    """``report`` with text (module docstring); token id lists stay."""
    out = dict(report)
    miss = out.get("miss")
    if miss is not None:
        miss = dict(miss)
        miss["text_before"] = decode(miss["before_ids"])
        miss["text_after"] = decode(miss["after_ids"])
        common = miss.get("most_common")
        if common is not None:
            miss["most_common"] = {**common, "text": decode(common["token_ids"])}
        out["miss"] = miss
    out["reason"] = reason(out)
    return out


def render_dashboard(decode: Decode, data: dict) -> dict:
    """``data`` with each tree node's ``label``."""
    tree = data.get("tree")
    if not tree:
        return data
    nodes = [{**n, "label": decode(n["label_ids"]).strip()} for n in tree["nodes"]]
    return {**data, "tree": {**tree, "nodes": nodes}}
