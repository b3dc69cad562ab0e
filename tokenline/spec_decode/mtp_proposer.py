"""Drafts from the model's own multi-token-prediction head (``--speculative mtp``), for the scheduler.

The drafting itself happens in the runner's step (``model/mtp_drafter.py``: the head reads the
target's hidden states there); each sampled token brings the drafts to follow it. This proposer
keeps them per request until the request's next step, and hands them out only if the request still
ends where they were drafted from (a stop, forced grammar tokens or a preemption in between make
them stale: that step goes without drafts and drafts afresh).
"""

from __future__ import annotations

from collections.abc import Sequence


class MtpProposer:
    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request id -> (its length then, drafts)

    def observe(self, request_id: str, num_tokens: int, drafts: Sequence[int]) -> None:
        """The runner drafted ``drafts`` to follow the request's first ``num_tokens`` tokens."""
        self._drafts[request_id] = (num_tokens, list(drafts))

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """The drafts kept for this request if they follow ``token_ids`` (at most ``max_drafts``)."""
        kept = self._drafts.pop(request_id, None)
        if kept is None or kept[0] != len(token_ids) or max_drafts <= 0:
            return []
        return kept[1][: min(max_drafts, self.num_speculative_tokens)]

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
