"""Who may reuse whose cached prompt prefix: the salt the engine folds into a prompt's first KV block.

A prefix-cache hit shows in ``usage.prompt_tokens_details.cached_tokens`` and in the time to the
first token, so a cache shared between tenants lets one tenant test guesses of another's prompt.
With the ``tenant`` scope (the default) each tenant's blocks carry a salt derived from its name:
only that tenant's requests can hit them. The caller's own ``cache_salt`` (vLLM's field) narrows
reuse further, within the tenant. The ``global`` scope salts with the caller's ``cache_salt``
alone, as vLLM does: every tenant shares the cache.

The salt travels as ``EngineRequest.cache_salt`` to the engine (``block_pool.salt_root``), to a
fleet's routing policy (``RouteRequest.cache_salt``) and to upstream servers (vLLM's
``cache_salt`` field), so a router computes the keys the engine caches under.
"""

from __future__ import annotations

import hashlib
import json

PREFIX_CACHE_SCOPES = ("tenant", "global")


def prefix_cache_salt(scope: str, tenant: str | None, cache_salt: str | None) -> str | None:
    """The engine's salt for a request of ``tenant`` (None: no keys configured) with the caller's
    ``cache_salt``. Tenant salts are digests, so tenant names never reach the engine's events or an
    upstream, and no ``cache_salt`` of one tenant can equal another tenant's salt."""
    if scope not in PREFIX_CACHE_SCOPES:
        raise ValueError(f"prefix cache scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}, got {scope!r}")
    if scope == "global" or tenant is None:
        return cache_salt
    digest = hashlib.sha256(json.dumps(["tokenline tenant", tenant, cache_salt]).encode()).hexdigest()
    return f"tenant-{digest[:32]}"
