"""How clients of every API steer the prefix cache: retention hints and cache keys.

A retention request becomes the scheduler's ``cache_retention`` hint
(``[level, seconds]``, docs/scheduler.md): under ``--radix-eviction-policy priority``
the request's cached prompt outlives unretained prefixes for that long, within the
per-tenant cap ``--max-retained-share`` and the global ``--max-retained-total-share``
(a hint past either is clipped to the prefix that fits, and the usage the request
gets back says so: ``retained_tokens`` is less than the prompt, 0 when nothing fit).

* OpenAI's ``prompt_cache_retention``: ``in_memory`` keeps the prompt for
  ``IN_MEMORY_SECONDS``, ``24h`` for a day (then, once evicted from the pool, in the
  host and disk tiers when the server has them: docs/cache-tiers.md);
* Anthropic's ``cache_control`` breakpoints: ``5m`` and ``1h`` (``anthropic_schema``).

Every hint has the same level (``RETENTION_LEVEL``): retained prefixes are evicted
after every unretained one, least recently used first among themselves.

OpenAI's ``prompt_cache_key`` names a group of requests sharing a prefix. It is a
routing key only (the router sends a key's requests to the same replica), never a
cache namespace: the namespace stays ``cache_salt``, so a key cannot reach a prefix
cached under another tenant's salt.
"""

from __future__ import annotations

RETENTION_LEVEL = 50
IN_MEMORY_SECONDS = 600.0  # OpenAI: an in-memory prompt cache lives 5 to 10 minutes idle
EXTENDED_SECONDS = 24 * 3600.0
PROMPT_CACHE_RETENTION = {"in_memory": IN_MEMORY_SECONDS, "24h": EXTENDED_SECONDS}


def retention_hint(seconds: float) -> tuple[int, float]:
    """The scheduler's ``cache_retention`` hint keeping a prompt for ``seconds``."""
    return (RETENTION_LEVEL, seconds)
