"""Options declared once: a config field that carries its help, its choices and its range.

A library's config declares each of its options as a dataclass field made by
``option``: its name and type are the field's, its default the field's default,
and the field's metadata holds the rest (``Option``). Everything else is derived:

- ``EngineConfig`` (``radixserve/config.py``) inherits every library's options;
- ``radixserve launch`` gets one flag per ``EngineConfig`` field, ``--name-with-dashes``,
  whose parsing, choices, range and help are the option's (``launch_flags.py``);
- each config checks its options' values in one place (``check_options``): a choice
  outside ``choices`` or a number outside its range is a ValueError naming the option,
  and the same check rejects a flag's value at parse time.

Options read by both the worker and the scheduler are declared here, in
``SharedOptions``, which both libraries' options inherit. This module imports nothing
of radixserve: every library may import it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

__all__ = [
    "LIMITS",
    "PARALLEL",
    "STRUCTURED",
    "Option",
    "SharedOptions",
    "check_options",
    "option",
    "option_of",
    "parse_size",
]

#: The sections of ``radixserve launch --help`` that options name (``Option.group``).
LIMITS = "limits on client input (docs/security.md)"
STRUCTURED = "structured output (docs/structured.md)"
PARALLEL = "tensor parallelism (docs/parallel.md)"

_METADATA_KEY = "radixserve.option"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "4GiB", "512M" or a plain integer (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    scale = 1024 ** " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * scale)


@dataclass(frozen=True)
class Option:
    """What an option's field carries besides its name, type and default.

    ``help``: one line or a few, the flag's help. ``choices``: the values accepted
    (strings). ``at_least`` / ``above`` / ``at_most``: the range of a number (None
    is accepted only where the default is None: it then means "derived").
    ``parse``: the flag's text to a value, where the field's type is not enough
    (``parse_size``). ``negatable``: a boolean option's flag also has its ``--no-``
    form (else it is a switch that only turns the option on). ``metavar``, ``group``:
    how ``--help`` shows the flag (``group``: one of the section titles above).
    """

    help: str
    choices: tuple[str, ...] = ()
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    parse: Callable[[str], Any] | None = None
    negatable: bool = True
    metavar: str | None = None
    group: str | None = None

    def problem(self, value: Any) -> str | None:
        """What is wrong with the number ``value``, None when nothing (its range)."""
        lo, hi = self.at_least, self.at_most
        if lo is not None and hi is not None and not lo <= value <= hi:
            return f"must be in [{lo:g}, {hi:g}], got {value}"
        if lo is not None and hi is None and not value >= lo:
            return f"must be >= {lo:g}, got {value}"
        if hi is not None and lo is None and not value <= hi:
            return f"must be <= {hi:g}, got {value}"
        if self.above is not None and not value > self.above:
            return f"must be > {self.above:g}, got {value}"
        return None


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] = (),
    at_least: float | None = None,
    above: float | None = None,
    at_most: float | None = None,
    parse: Callable[[str], Any] | None = None,
    negatable: bool = True,
    metavar: str | None = None,
    group: str | None = None,
) -> Any:
    """A config field holding an option (see ``Option`` for the arguments)."""
    spec = Option(help, choices, at_least, above, at_most, parse, negatable, metavar, group)
    if default is not None and spec.problem(default) is not None:
        raise ValueError(f"an option's default {default!r} {spec.problem(default)}")
    if default is not None and choices and default not in choices:
        raise ValueError(f"an option's default {default!r} is not one of {choices}")
    return field(default=default, metadata={_METADATA_KEY: spec})


def option_of(f: Field) -> Option | None:
    """The ``Option`` a dataclass field carries, None for a field that is no option."""
    return f.metadata.get(_METADATA_KEY)


def check_options(config: Any) -> None:
    """Every option's value of the dataclass ``config`` checked against its ``Option``
    (ValueError naming the first one that is not accepted)."""
    for f in fields(config):
        spec = option_of(f)
        if spec is None:
            continue
        value = getattr(config, f.name)
        if value is None:
            if f.default is not None:
                raise ValueError(f"{f.name} must be given (None is not accepted)")
            continue
        if spec.choices and value not in spec.choices:
            raise ValueError(f"unsupported {f.name} {value!r}; choose from {spec.choices}")
        problem = spec.problem(value)
        if problem is not None:
            raise ValueError(f"{f.name} {problem}")


@dataclass(frozen=True, kw_only=True)
class SharedOptions:
    """The options both the worker and the scheduler read."""

    max_running_requests: int = option(64, "requests decoding at once (worker slots)", at_least=1)
    # The scheduler's step size; the worker warms up with a prefill of this many tokens.
    chunked_prefill_size: int = option(2048, "most prompt tokens computed per step", at_least=1)
    # The worker writes the disk tier's files, the scheduler indexes them.
    disk_cache_dir: str | None = option(
        None,
        "the KV cache's disk tier: a directory of page files, written through as pages "
        "are computed, that survives restarts (through a host tier: --host-cache-gb, or "
        "one sized from free memory)",
    )
