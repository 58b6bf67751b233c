"""What ``radixserve bench`` runs against: one target per variant.

``variants`` turns ``--compare``, ``--server-args``, ``--endpoint`` and
``--backend`` into (label, launch flags) pairs (flags None: a server that is
already running); ``make_backend`` and ``make_engine`` build the backend a
variant runs on. Both the fixed workloads (``cli.py``) and the prompt programs
(``programs.py``) use them, so they live below both.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
from collections.abc import Sequence
from typing import Any

from radixserve.benchmark.backends import Backend, OpenAIBackend, RadixserveBackend
from radixserve.launch_flags import config_from_args, launch_parser


def variants(args: argparse.Namespace) -> list[tuple[str, list[str] | None]]:
    """(label, launch flags) per variant; flags None: an existing server."""
    if args.backend == "engine" and (args.endpoint or args.base_url):
        raise SystemExit(
            "radixserve bench: --backend engine runs in-process: drop --endpoint/--base-url"
        )
    if args.endpoint or args.backend == "openai":
        if args.compare:
            raise SystemExit(
                "radixserve bench: --compare launches servers; drop --endpoint/--base-url"
            )
        return [(args.endpoint or args.base_url or "openai", None)]
    base = ["--model", args.model, *shlex.split(args.server_args)]
    if not args.compare:
        return [("launched", base)]
    axes = []
    for spec in args.compare:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise SystemExit(f"radixserve bench: --compare wants KEY=V1,V2, got {spec!r}")
        axes.append([(key, v) for v in values.split(",")])
    out = []
    for combo in itertools.product(*axes):
        label = ",".join(f"{k}={v}" for k, v in combo)
        out.append((label, base + [a for k, v in combo for a in compare_flags(k, v)]))
    return out


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def compare_flags(key: str, value: str) -> list[str]:
    """The launch flags that give ``radixserve launch``'s ``--KEY`` the value ``value``:
    ``--KEY VALUE``; for a boolean flag (``--KEY/--no-KEY``, or a switch) ``value``
    is true or false and the flags are ``--KEY`` or ``--no-KEY`` (a switch: ``--KEY``
    or nothing)."""
    flag = "--" + key.replace("_", "-")
    action = _launch_options().get(flag)
    if action is None:
        raise SystemExit(f"radixserve bench: --compare {key}: radixserve launch has no {flag}")
    boolean = isinstance(action, argparse.BooleanOptionalAction)
    switch = isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction)
    if not boolean and not switch:
        return [flag, value]
    if value.lower() not in _TRUE + _FALSE:
        raise SystemExit(f"radixserve bench: --compare {key}: {flag} is a switch: true or false")
    on = value.lower() in _TRUE
    if boolean:
        return [flag] if on else ["--no-" + flag[2:]]
    return [flag] if on == action.const else []


def _launch_options() -> dict[str, argparse.Action]:
    """``radixserve launch``'s options by flag."""
    return dict(launch_parser()._option_string_actions)


def make_backend(args: argparse.Namespace, endpoint: str | None) -> Backend:
    if args.backend == "openai":
        if not args.base_url:
            raise SystemExit("radixserve bench: --backend openai needs --base-url")
        extra = json.loads(args.extra_body) if args.extra_body else None
        prompt_text = None
        if args.text_prompts:
            from radixserve.models.tokenizer import load_tokenizer

            tok = load_tokenizer(args.tokenizer or args.model)
            prompt_text = lambda ids: tok.decode(list(ids))  # noqa: E731
            # No ignore_eos there: the end-of-text token is kept from being sampled.
            extra = {"logit_bias": {str(tok.eos_token_id): -100.0}, **(extra or {})}
        return OpenAIBackend(
            args.base_url, args.served_model, args.server_page_size, extra,
            timeout=args.timeout, prompt_text=prompt_text,
        )  # fmt: skip
    return RadixserveBackend(endpoint or args.endpoint, timeout=args.timeout)


def make_engine(launch_args: Sequence[str]) -> Any:
    """An in-process Engine configured exactly as ``radixserve launch LAUNCH_ARGS`` would be."""
    from dataclasses import fields

    from radixserve.engine import Engine

    config = config_from_args(launch_parser().parse_args(list(launch_args))).engine
    return Engine(**{f.name: getattr(config, f.name) for f in fields(config)})
