"""The import graph of ``radixserve/`` has no circle and every import points down the
layers of docs/architecture.md.

Read from the source with ``ast`` (function-local and ``TYPE_CHECKING`` imports
count: each is a dependency a reader must follow), so it holds without importing
anything. ``LAYERS`` is the table of docs/architecture.md, bottom first; a module
belongs to the layer that names it, else to the first whose ``pkg.*`` holds it
(the package and everything in it: so ``radixserve.worker.*`` is the worker's
library, and ``radixserve.worker.process``, named higher up, its process). An import may go to a lower layer, or stay in its own
layer and its own package (``radixserve.worker.*`` among themselves; the top-level
modules among themselves); two packages of one layer never import each other.
A new module must be placed in a layer before this passes.
"""

from __future__ import annotations

import ast
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "radixserve"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("store plumbing", ("radixserve.utils.kv_store",)),
    (
        "declarations",
        ("radixserve.options", "radixserve.combinations"),
    ),
    (
        "base",
        (
            "radixserve.sampling_params",
            "radixserve.results",
            "radixserve.structured",
            "radixserve.model_info",
            "radixserve.curve",
            "radixserve.auth_env",
            "radixserve.version",
            "radixserve.utils",
            "radixserve.utils.kv_file",
            "radixserve.utils.mooncake",
            "radixserve.utils.sockets",
            "radixserve.utils.descriptors",
            "radixserve.utils.zmtp_server",
            "radixserve.utils.zmtp_gate",
            "radixserve.utils.paths",
        ),
    ),
    ("protocol", ("radixserve.protocol.*",)),
    ("model layers", ("radixserve.layers.*",)),
    ("models", ("radixserve.models.*",)),
    (
        "libraries",
        (
            "radixserve.scheduler.*",
            "radixserve.tokenizer.*",
            "radixserve.worker.*",
            "radixserve.program.*",
        ),
    ),
    ("config", ("radixserve.config", "radixserve.server_config")),
    ("server plumbing", ("radixserve.utils.proc", "radixserve.nodes", "radixserve.zap")),
    ("tensor-parallel ranks", ("radixserve.worker.relay", "radixserve.worker.tp")),
    ("composition", ("radixserve.compose",)),
    (
        "processes",
        (
            "radixserve.engine",
            "radixserve.scheduler.process",
            "radixserve.worker.process",
            "radixserve.tokenizer.process",
            "radixserve.tokenizer.connections",
            "radixserve.tokenizer.public_socket",
        ),
    ),
    ("client library", ("radixserve.client.*",)),
    ("HTTP front", ("radixserve.http.*",)),
    ("launcher", ("radixserve.launch",)),
    ("router", ("radixserve.router.*",)),
    ("command line", ("radixserve.launch_flags", "radixserve.keys_command")),
    ("tools", ("radixserve.benchmark.*", "radixserve.demo")),
    ("the radixserve command", ("radixserve.cli",)),
    ("facade", ("radixserve", "radixserve.__main__")),
]


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module under radixserve/ by dotted name, with whether it is a package."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def imports(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[tuple[str, int]]]:
    """Each module's imports of radixserve modules, as (module, line)."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[tuple[str, int]]] = {}
    for name, (path, is_package) in mods.items():
        package = name if is_package else name.rpartition(".")[0]
        found: set[tuple[str, int]] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                # ``from pkg import mod`` names a module; ``from mod import name`` its module
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            else:
                continue
            for target in targets:
                if target == "radixserve" or target.startswith("radixserve."):
                    resolved = resolve(target)
                    if resolved is not None and resolved != name:
                        found.add((resolved, node.lineno))
        graph[name] = found
    return graph


def layer_of(module: str) -> int:
    """A module's layer: the one naming it exactly, else the first whose ``pkg.*`` holds it."""
    for i, (_, patterns) in enumerate(LAYERS):
        if module in patterns:
            return i
    for i, (_, patterns) in enumerate(LAYERS):
        if any(p.endswith(".*") and (fnmatchcase(module, p) or module == p[:-2]) for p in patterns):
            return i
    raise LookupError(module)


def unit(module: str) -> str:
    """The package a module belongs to for the same-layer rule (top-level modules: one)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module in PACKAGES else "radixserve"


MODS = modules()
PACKAGES = {m for m, (_, is_package) in MODS.items() if is_package}
GRAPH = imports(MODS)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    unplaced = []
    for m in MODS:
        try:
            layer_of(m)
        except LookupError:
            unplaced.append(m)
    assert not unplaced, f"place these in LAYERS (and docs/architecture.md): {unplaced}"


# No circle is allowed (the FlashInfer probe's command line lives in
# ``worker/attention/check_flashinfer.py``, above the package it drives).
KNOWN_CIRCLES: list[list[str]] = []


def test_no_import_circle():
    graph = {m: {t for t, _ in targets} for m, targets in GRAPH.items()}
    assert [c for c in circles(graph) if c not in KNOWN_CIRCLES] == []


def test_imports_point_down_the_layers():
    upward = []
    for m, targets in GRAPH.items():
        for t, line in sorted(targets):
            lm, lt = layer_of(m), layer_of(t)
            if lt < lm or (lt == lm and unit(t) == unit(m)):
                continue
            upward.append(f"{m}:{line} ({LAYERS[lm][0]}) -> {t} ({LAYERS[lt][0]})")
    assert not upward, "\n".join(upward)


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path):
    # The checks themselves can fail: a two-module loop, and a library importing a process.
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert layer_of("radixserve.scheduler.scheduler") < layer_of("radixserve.scheduler.process")
    assert layer_of("radixserve.config") > layer_of("radixserve.worker.config")
    with pytest.raises(LookupError):
        layer_of("elsewhere.module")


def test_docs_draw_the_same_layers():
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    table = doc.split("## Layers", 1)[1].split("\n\n")[2]
    rows = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert rows[::-1] == [name for name, _ in LAYERS], (
        "docs/architecture.md lists the layers top first"
    )
