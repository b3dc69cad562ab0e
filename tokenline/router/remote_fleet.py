"""``tokenline router``'s engine: remote upstream servers behind one ``FleetClient``.

Every ``--upstream`` becomes a ``RemoteEngineClient`` named by its host:port (the ``upstream``
label on ``/metrics``). The default policy reads KV events when every upstream publishes them
(precise prefix affinity, evictions seen) and otherwise learns prefixes from the requests it
routed (approximate affinity).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenline.engine.client import EngineClient
from tokenline.router.data_parallel import build_policy
from tokenline.router.fleet import FleetClient
from tokenline.router.remote_client import (
    RemoteEngineClient,
    UpstreamSpec,
    parse_upstream,
)


def default_router_policy(specs: Sequence[UpstreamSpec]) -> str:
    """``kv_events`` when every upstream publishes KV events, else ``prefix``."""
    return "kv_events" if specs and all(s.kv_events for s in specs) else "prefix"


def parse_upstreams(values: Sequence[str]) -> list[UpstreamSpec]:
    """Parse ``--upstream`` values; ``ValueError`` for a bad one, none, or the same one twice."""
    if not values:
        raise ValueError("tokenline router needs at least one --upstream URL")
    specs = [parse_upstream(v) for v in values]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--upstream given twice: {', '.join(duplicates)}")
    if len({s.kind == "openai" for s in specs}) > 1:
        raise ValueError("--upstream kinds mixed: kind=openai upstreams take text and the others token ids, so one "
                         "request could not be retried or routed across both; run one router per kind")
    return specs


def remote_fleet(
    upstreams: Sequence[str],
    policy_name: str | None = None,
    session_affinity: bool = False,
    *,
    api_key: str | None = None,
    health_interval: float = 2.0,
    unhealthy_after: int = 3,
    seed: int | None = None,
) -> FleetClient:
    specs = parse_upstreams(upstreams)
    policy = build_policy(policy_name or default_router_policy(specs), session_affinity, seed)
    if specs[0].kind == "openai":
        from tokenline.router.passthrough import HostedUpstream as member_type
    else:
        member_type = RemoteEngineClient
    members: dict[str, EngineClient] = {
        spec.name: member_type(spec, api_key=api_key, health_interval=health_interval,
                                      unhealthy_after=unhealthy_after)
        for spec in specs
    }
    # Passive ejection lasts a few health intervals: the active check then says whether it is back.
    return FleetClient(members, policy, eject_s=max(5.0, 3 * health_interval))
