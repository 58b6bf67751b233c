"""Options declared once: a config field that carries its help, its choices and its range.

A config declares each of its options as a dataclass field made by ``option``: its
name and type are the field's, its default the field's default, and the field's
metadata holds the rest (``Option``). The libraries' configs declare theirs
(``WorkerOptions``, ``SchedulerOptions``, ``TokenizerOptions``), the server's
``ServerConfig`` its own. Everything else is derived:

- ``EngineConfig`` (``radixserve/config.py``) inherits every library's options;
- ``radixserve launch`` gets one flag per ``EngineConfig`` field (and per option of
  its ``ServerConfig``), ``--name-with-dashes``, whose parsing, choices, range and help
  are the option's (``add_option_flags``, called by ``launch_flags.py``);
- each config checks its options' values in one place (``check_options``): a choice
  outside ``choices`` or a number outside its range is a ValueError naming the option,
  and the same check rejects a flag's value at parse time.

An option two configs read is declared by one and taken by the other with
``option_from`` (``radixserve router``'s ``--host``, ``--model``, ... are the server's
and the engine's); a config whose options another holds as a whole is a ``nested``
field of it, whose flags are added in its place (the router's ``PolicyConfig``, which
``radixserve launch --dp`` also reads, and ``utils/descriptors.py``'s
``ConnectionOptions``). ``option_values`` reads a parsed command line back into
option values, ``option_flags`` writes a config's values out as flags.

Options read by both the worker and the scheduler are declared here, in
``SharedOptions``, which both libraries' options inherit. This module imports nothing
of radixserve: every library may import it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

__all__ = [
    "AUTHENTICATION",
    "EVENTS",
    "GROUPS",
    "LIMITS",
    "PARALLEL",
    "STRUCTURED",
    "Option",
    "SharedOptions",
    "add_option_flags",
    "check_options",
    "flag_arguments",
    "flag_of",
    "nested",
    "nested_of",
    "option",
    "option_flags",
    "option_from",
    "option_of",
    "option_values",
    "parse_size",
]

#: The sections of ``radixserve launch --help`` that options name (``Option.group``).
LIMITS = "limits on client input (docs/security.md)"
STRUCTURED = "structured output (docs/structured.md)"
PARALLEL = "tensor parallelism (docs/parallel.md)"
AUTHENTICATION = "authentication (docs/security.md)"
EVENTS = "KV cache events and replicas (docs/scale-out.md)"
#: The sections in the order ``--help`` shows them.
GROUPS = (LIMITS, STRUCTURED, PARALLEL, AUTHENTICATION, EVENTS)

_METADATA_KEY = "radixserve.option"
_NESTED_KEY = "radixserve.nested"
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

    ``help``: one line or a few, the flag's help (``argparse.SUPPRESS``: a flag
    ``--help`` does not show). ``choices``: the values accepted
    (strings). ``at_least`` / ``above`` / ``at_most``: the range of a number (None
    is accepted only where the default is None: it then means "derived").
    ``parse``: the flag's text to a value, where the field's type is not enough
    (``parse_size``). ``check``: a test of the value beyond choices and range, which
    raises ValueError saying what is wrong. ``negatable``: a boolean option's flag also has its ``--no-``
    form (else it is a switch that only turns the option on). ``metavar``, ``group``:
    how ``--help`` shows the flag (``group``: one of the section titles above).
    """

    help: str
    choices: tuple[str, ...] = ()
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    parse: Callable[[str], Any] | None = None
    check: Callable[[Any], object] | None = None
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
    check: Callable[[Any], object] | None = None,
    negatable: bool = True,
    metavar: str | None = None,
    group: str | None = None,
) -> Any:
    """A config field holding an option (see ``Option`` for the arguments)."""
    spec = Option(help, choices, at_least, above, at_most, parse, check, negatable, metavar, group)
    return _option_field(default, spec)


def _option_field(default: Any, spec: Option) -> Any:
    if default is not None and spec.problem(default) is not None:
        raise ValueError(f"an option's default {default!r} {spec.problem(default)}")
    if default is not None and spec.choices and default not in spec.choices:
        raise ValueError(f"an option's default {default!r} is not one of {spec.choices}")
    return field(default=default, metadata={_METADATA_KEY: spec})


def option_from(cls: type, name: str, *, default: Any = MISSING, **changes: Any) -> Any:
    """A config field holding the option ``name`` of the config ``cls``: its default and
    ``Option``, but for what ``default`` and ``changes`` (``Option``'s fields by name)
    say. One option that two configs read is so declared once."""
    f = cls.__dataclass_fields__[name]
    spec = option_of(f)
    if spec is None:
        raise TypeError(f"{cls.__name__}.{name} is not declared with options.option")
    return _option_field(f.default if default is MISSING else default, replace(spec, **changes))


def nested(cls: type) -> Any:
    """A config field holding a whole config ``cls`` (default: its defaults) whose options
    are the holder's too: ``add_option_flags`` adds their flags in its place and
    ``option_values`` builds it from them."""
    return field(default_factory=cls, metadata={_NESTED_KEY: cls})


def option_of(f: Field) -> Option | None:
    """The ``Option`` a dataclass field carries, None for a field that is no option."""
    return f.metadata.get(_METADATA_KEY)


def nested_of(f: Field) -> type | None:
    """The config a ``nested`` field holds, None for any other field."""
    return f.metadata.get(_NESTED_KEY)


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
        if spec.check is not None:
            spec.check(value)


def flag_of(name: str) -> str:
    """The flag of the option ``name``: ``--name-with-dashes``."""
    return "--" + name.replace("_", "-")


def _checked(parse: Callable[[str], Any], spec: Option) -> Callable[[str], Any]:
    """``parse``, then ``spec``'s range: a value out of it is a usage error."""

    def convert(text: str) -> Any:
        value = parse(text)
        problem = spec.problem(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = parse.__name__  # argparse names it in "invalid int value"
    return convert


def flag_arguments(f: Field, kind: Any) -> dict[str, Any]:
    """``add_argument``'s keyword arguments for the option field ``f`` of type ``kind``
    (its annotation, resolved): dest, default, help, and how its text is read."""
    spec = option_of(f)
    if spec is None:
        raise TypeError(f"{f.name} is not declared with options.option")
    args: dict[str, Any] = {"dest": f.name, "default": f.default, "help": spec.help}
    if get_origin(kind) in (Union, UnionType):  # ``T | None``: None means derived
        (kind,) = (k for k in get_args(kind) if k is not type(None))
    if kind is bool:
        action = argparse.BooleanOptionalAction if spec.negatable else "store_true"
        return {**args, "action": action}
    if get_origin(kind) is tuple:  # ``tuple[T, ...]``: one value or more
        kind = get_args(kind)[0]
        args["nargs"] = "+"
    if spec.choices:
        args["choices"] = spec.choices
    parse = spec.parse or kind
    args["type"] = parse if parse is str else _checked(parse, spec)
    if spec.metavar:
        args["metavar"] = spec.metavar
    return args


def add_option_flags(
    p: Any,
    cls: type,
    groups: dict[str, Any],
    exclusive: tuple[tuple[str, ...], ...] = (),
    changes: dict[str, dict[str, Any]] | None = None,
) -> None:
    """One flag per option field of the dataclass ``cls`` on the parser ``p``, or in the
    argument group of ``groups`` (by title) its option names; a ``nested`` config's flags
    in its place. The flags of each name set in ``exclusive`` exclude each other;
    ``changes`` overrides ``add_argument``'s arguments of a field by name (where a
    command line reads an option its own way)."""
    kinds = get_type_hints(cls)
    placed: dict[str, Any] = {}
    for names in exclusive:
        placed.update(dict.fromkeys(names, p.add_mutually_exclusive_group()))
    for f in fields(cls):
        if (inner := nested_of(f)) is not None:
            add_option_flags(p, inner, groups, changes=changes)
        spec = option_of(f)
        if spec is None:
            continue
        args = {**flag_arguments(f, kinds[f.name]), **(changes or {}).get(f.name, {})}
        target = placed.get(f.name) or groups.get(spec.group) or p
        target.add_argument(flag_of(f.name), **args)


def option_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of the option fields of the dataclass ``cls`` on a command line parsed
    by its flags (whose dests are the fields' names; ``nargs="+"`` gives lists, configs
    hold tuples), and its ``nested`` configs built from theirs."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        if (inner := nested_of(f)) is not None:
            values[f.name] = inner(**option_values(inner, args))
        elif option_of(f) is not None:
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def option_flags(config: Any) -> list[str]:
    """The flags that give each option of the dataclass instance ``config`` (its
    ``nested`` configs' too) its value: none for a value that is the default, nor for a
    None that is not (no flag says None)."""
    args: list[str] = []
    for f in fields(config):
        value = getattr(config, f.name)
        if nested_of(f) is not None:
            args += option_flags(value)
        spec = option_of(f)
        if spec is None or value == f.default or value is None:
            continue
        flag = flag_of(f.name)
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return args


def _store_url(url: str) -> object:
    """``--kv-store``'s check (``utils/kv_store.py``, stdlib only, imported when used)."""
    from radixserve.utils.kv_store import parse_store_url

    return parse_store_url(url)


def _store_config(text: str) -> object:
    """``--kv-store-config``'s check."""
    from radixserve.utils.kv_store import StoreConfig

    return StoreConfig.parse(text)


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
    # The worker reads and writes the store; the scheduler plans what to read and write.
    kv_store: str | None = option(
        None,
        "a KV store shared by every replica and machine serving this model, below the "
        "host tier: mooncake://HOST:PORT, the address of a mooncake_master "
        "(radixserve launch: mooncake://auto starts one for its replicas); needs "
        "radixserve[mooncake] (docs/cache-tiers.md)",
        check=_store_url,
        metavar="URL",
    )
    kv_store_config: str | None = option(
        None,
        "Mooncake's settings for --kv-store, a JSON object: local_hostname, segment_mb "
        "(memory lent to the store, default 512), buffer_mb (64), protocol (tcp or "
        "rdma), device (RDMA NICs), timeout_s (a read or write slower than this "
        "fails: a miss, a page not written; 2), write (insert: every computed page, "
        "the default; evict: pages leaving the pool)",
        check=_store_config,
        metavar="JSON",
    )
