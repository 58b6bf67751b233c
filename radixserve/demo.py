"""``make run``: launch a server with the embedded SmolLM2 and talk to it.

Starts ``radixserve launch --port 0`` in a subprocess, sends a few chat requests
that share a system prompt through the client library, prints each answer with
its cached token count and the server's stats, then stops the server. With
``--serve`` the server keeps serving at the printed endpoint until Ctrl-C.

    python -m radixserve.demo [--model smollm2] [--serve] [launch flags...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys

from radixserve.client import AsyncClient
from radixserve.utils.paths import SOURCE_ROOT

SYSTEM = (
    "You are a concise geography tutor. Answer every question in one short sentence, "
    "name the country when you name a city, and do not add greetings or follow-up questions."
)
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Italy?",
    "What is the capital of Japan?",
    "Which river flows through Cairo?",
]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    root = SOURCE_ROOT
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    endpoint = ""
    for line in proc.stdout:  # type: ignore[union-attr]
        print(line, end="", flush=True)
        if m := re.search(r"serving on (\S+)", line):
            endpoint = m.group(1)
        if "processes" in line:
            return proc, endpoint
    raise SystemExit(f"the server did not start (exit code {proc.wait()})")


async def ask_all(endpoint: str) -> None:
    async with AsyncClient(endpoint, timeout=600) as client:

        async def ask(question: str):
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ]
            return await client.generate(messages=messages, max_tokens=48, temperature=0.0)

        # The first request computes the shared system prompt; the others, sent together,
        # find it in the radix tree and compute only their own question.
        results = [await ask(QUESTIONS[0])]
        results += await asyncio.gather(*(ask(q) for q in QUESTIONS[1:]))
        for question, r in zip(QUESTIONS, results):
            u = r.usage
            print(f"\nQ: {question}\nA: {r.text.strip()}")
            print(f"   prompt {u.prompt_tokens} tokens, {u.cached_tokens} from the cache")
        stats = await client.stats()
        print(
            f"\ncache: {stats['hit_tokens']} of {stats['query_tokens']} prompt tokens were hits; "
            f"{stats['pages_cached']} pages cached, {stats['pages_free']} free"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help="keep serving until Ctrl-C")
    args, launch_flags = parser.parse_known_args(argv)
    proc, endpoint = start_server(launch_flags)
    try:
        asyncio.run(ask_all(endpoint))
        if args.serve:
            print(f"\nserving on {endpoint} until Ctrl-C", flush=True)
            return proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
