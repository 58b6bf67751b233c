"""API keys of the HTTP front (``--api-key``, ``--admin-api-key``), as vLLM's ``--api-key``.

With an API key set, ``/v1/*``, ``/stats``, ``/tokenize``, ``/detokenize`` and SGLang's
``/generate`` and info routes need ``Authorization: Bearer <key>`` (or Anthropic's
``x-api-key: <key>`` header, which its clients send); ``/flush_cache``,
``/reset_prefix_cache`` and ``/abort_request`` need the admin key when one is set (else
the API key). The admin key is accepted wherever the API key is. ``/health``,
``/health_generate`` and ``/metrics`` stay open (load balancers and Prometheus probe them). A missing or wrong key is a 401 in
OpenAI's shape, code ``invalid_api_key``; keys are compared in constant time.

The keys reach the HTTP process through its environment (``API_KEY_ENV``,
``ADMIN_KEY_ENV``), never its command line, which any local user can read.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixserve.auth_env import ADMIN_KEY_ENV, API_KEY_ENV

if TYPE_CHECKING:  # the launcher imports this module too, without the web stack
    from fastapi import Request


@dataclass(frozen=True)
class Keys:
    api_key: str | None = None
    admin_key: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Keys:
        return cls(env.get(API_KEY_ENV) or None, env.get(ADMIN_KEY_ENV) or None)

    def env(self) -> dict[str, str]:
        """The environment entries that carry these keys to the HTTP process."""
        out = {API_KEY_ENV: self.api_key, ADMIN_KEY_ENV: self.admin_key}
        return {k: v for k, v in out.items() if v}

    def wanted(self, admin: bool = False) -> list[str]:
        """The keys that open a route (none: it is open)."""
        if admin:
            wanted = [self.admin_key] if self.admin_key else [self.api_key]
        else:  # open without an API key; the admin key opens it too
            wanted = [self.api_key, self.admin_key] if self.api_key else []
        return [k for k in wanted if k]

    def check(self, request: Request, admin: bool = False) -> None:
        """Raise a 401 unless the request brings a key that opens this route."""
        wanted = self.wanted(admin)
        if not wanted:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and any(same_key(given.strip(), k) for k in wanted):
            return
        anthropic = request.headers.get("x-api-key")
        if anthropic is not None and any(same_key(anthropic.strip(), k) for k in wanted):
            return
        from radixserve.http.errors import HTTPError

        what = "the admin API key" if admin and self.admin_key else "an API key"
        raise HTTPError(401, f"this route needs {what}: Authorization: Bearer <key>",
                        code="invalid_api_key")  # fmt: skip


NO_KEYS = Keys()  # every route open, as without --api-key


def same_key(given: str, key: str) -> bool:
    """Whether ``given`` is ``key``, compared in constant time."""
    return hmac.compare_digest(given.encode(), key.encode())
