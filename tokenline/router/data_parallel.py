"""``--data-parallel-size N``: N local engine processes behind one API process.

Each engine is an ``EngineProcessClient`` with its own rank, threads and KV-event ports
(``engine.config.data_parallel_configs``); a ``FleetClient`` routes between them. KV events reach
the policy through the engines' pipes with every step, so precise prefix affinity costs no socket.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tokenline.engine.client import RestartPolicy
from tokenline.engine.config import EngineConfig, data_parallel_configs
from tokenline.engine.process_client import EngineProcessClient
from tokenline.router.fleet import FleetClient
from tokenline.router.policy import RoutingPolicy

DEFAULT_DATA_PARALLEL_POLICY = "kv_events"  # the engines' own events come with each step for free


def build_policy(name: str, session_affinity: bool = False, seed: int | None = None) -> RoutingPolicy:
    """A policy by name (``ValueError`` names the known ones), optionally sticky per session."""
    from tokenline.router.policies import SessionAffinity, make_policy

    policy = make_policy(name, seed=seed)
    return SessionAffinity(policy) if session_affinity else policy


def local_fleet(
    config: EngineConfig,
    model_dir: Path,
    vocab_size: int | None,
    size: int,
    *,
    threads_per_engine: int | None = None,
    policy: RoutingPolicy,
    kv_events: bool = False,
    restart: RestartPolicy | None = None,
) -> FleetClient:
    """``size`` engine processes named ``engine-0`` … behind one ``FleetClient``; ``kv_events``:
    the engines record KV events (the policy reads them from each step)."""
    if kv_events:
        config = dataclasses.replace(config, enable_kv_cache_events=True)
    members = {
        f"engine-{c.data_parallel_rank}": EngineProcessClient(c, model_dir, vocab_size, restart)
        for c in data_parallel_configs(config, size, threads_per_engine)
    }
    return FleetClient(members, policy)
