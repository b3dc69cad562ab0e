"""The one line ``tokenline simulate`` prints when its profile may not hold for what it simulates:
calibrated under load, or for another dtype, thread count or step budget than the simulated server's."""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.sim.profile import Profile


@dataclass(frozen=True)
class SimulatedSetup:
    """The server a simulation on the calibrated machine stands for (``serve``'s defaults unless given)."""

    dtype: str  # resolved: float32, bfloat16
    threads: int
    max_num_batched_tokens: int


def profile_warning(profile: Profile, setup: SimulatedSetup, path: str = "the profile") -> str | None:
    """None when the profile was calibrated quiet and for ``setup``; else one line saying why not."""
    reasons = []
    load = profile.load or {}
    if load.get("under_load"):
        shares = [load.get("before_share") or 0.0, load.get("worst_share") or 0.0, load.get("server_share") or 0.0]
        reasons.append(f"calibrated under load (neighbours took up to {max(shares):.0%} of the CPU)")
    if profile.dtype != setup.dtype:
        reasons.append(f"dtype {profile.dtype} (simulating {setup.dtype})")
    threads = profile.machine.get("torch_threads")
    if threads is not None and threads != setup.threads:
        reasons.append(f"{threads} torch threads (simulating {setup.threads})")
    budget = profile.max_num_batched_tokens
    if budget is not None and setup.max_num_batched_tokens > budget:
        reasons.append(f"steps of at most {budget} tokens (simulating a budget of {setup.max_num_batched_tokens})")
    if not reasons:
        return None
    return f"warning: {path} was " + "; ".join(reasons) + ": its predictions may not hold"


def this_setup(dtype: str, threads: int | None, max_num_batched_tokens: int) -> SimulatedSetup:
    """``serve``'s resolution of ``--dtype`` and the engine's thread count on this machine."""
    import torch

    from tokenline.model.loader import resolve_dtype

    resolved = str(resolve_dtype(dtype, "cpu")).removeprefix("torch.")
    return SimulatedSetup(resolved, threads or torch.get_num_threads(), max_num_batched_tokens)
