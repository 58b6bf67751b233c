"""The cache's tree as an SVG icicle: the picture the dashboard draws (``http/static/
dashboard.html``), written by ``radixserve bench`` next to its plot.

Input: the ``tree`` of the dashboard's figures (``scheduler/monitor.py``'s ``outline``,
labels written by the tokenizer): the largest prefixes, each with its parent. Each box
is a cached edge: x from its depth, width its tokens, height the tokens cached in and
below it (siblings share their parent's height by that weight); colour how recently it
was used (warm: now, cool: long ago); outlined while a request holds it.
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Any

WIDTH, HEIGHT, TOP = 900, 420, 28


def icicle_svg(tree: dict[str, Any], title: str = "") -> str:
    """The SVG document for ``tree`` (an empty tree draws an empty frame)."""
    nodes = tree.get("nodes", [])
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT + TOP}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{HEIGHT + TOP}" fill="#fff"/>',
        f'<text x="4" y="18" font-size="13">{escape(title)}</text>',
    ]
    if nodes:
        kids: list[list[int]] = [[] for _ in nodes]
        tops = []
        for i, n in enumerate(nodes):
            (tops if n["parent"] < 0 else kids[n["parent"]]).append(i)
        end = max(n["depth"] + n["tokens"] for n in nodes)
        max_age = max(1, *(n["age"] for n in nodes))
        sx = (WIDTH - 2) / end

        def place(ids: list[int], y0: float, y1: float, total: int) -> None:
            y = y0
            for i in ids:
                n = nodes[i]
                h = (y1 - y0) * n["subtree_tokens"] / total
                a = math.sqrt(n["age"] / max_age)
                fill = f"hsl({12 + 203 * a:.0f},{75 - 15 * a * a:.0f}%,{58 + 12 * a:.0f}%)"
                x, w = 1 + n["depth"] * sx, max(1.0, n["tokens"] * sx - 1)
                stroke = ' stroke="#111"' if n["locked"] else ""
                label = n.get("label", "")
                parts.append(
                    f'<rect x="{x:.1f}" y="{TOP + y:.1f}" width="{w:.1f}" '
                    f'height="{max(1.0, h - 1):.1f}" fill="{fill}"{stroke}>'
                    f"<title>{escape(label)} ({n['tokens']} tokens at {n['depth']}, "
                    f"{n['subtree_tokens']} below)</title></rect>"
                )
                room = int((w - 6) / 6)
                if h >= 13 and room > 3:
                    text = label if len(label) <= room else label[: room - 1] + "…"
                    parts.append(
                        f'<text x="{x + 3:.1f}" y="{TOP + y + min(h / 2 + 4, 14):.1f}">'
                        f"{escape(text)}</text>"
                    )
                if kids[i]:
                    place(kids[i], y, y + h, n["subtree_tokens"])
                y += h

        place(tops, 0, HEIGHT, sum(nodes[i]["subtree_tokens"] for i in tops))
    parts.append("</svg>")
    return "\n".join(parts)


def write_tree(path: Path, tree: dict[str, Any], title: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(icicle_svg(tree, title))
