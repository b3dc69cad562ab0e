"""N-gram (prompt-lookup) drafting for speculative decoding, like vLLM's ``ngram`` method.

What a model is about to write often sits in its context already: a passage it quotes, code it
edits, a list it repeats. The proposer finds the latest earlier occurrence of the sequence's last
``n`` tokens and proposes the tokens that followed it; the target model then checks them all in
one step. No draft model: one substring search per sequence and step.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = array("i").itemsize  # bytes per token id in the search buffer


class NgramProposer:
    """Drafts up to ``num_speculative_tokens`` tokens per sequence by prompt lookup.

    It keeps each sequence's ids as packed bytes, extended by the new tokens each step, so a
    search is one C-level ``rfind`` per n-gram size over the sequence: O(length), no Python loop
    over the tokens.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        check_ngram_settings(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._ids: dict[str, array] = {}  # request id -> its token ids, packed

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Draft tokens to follow ``token_ids`` (at most ``max_drafts``; often none)."""
        k = min(self.num_speculative_tokens, max_drafts)
        if k <= 0:
            return []
        packed = self._ids.get(request_id)
        if packed is None or len(packed) > len(token_ids):
            packed = self._ids[request_id] = array("i", token_ids)
        elif len(packed) < len(token_ids):
            packed.extend(token_ids[len(packed) :])  # sequences only grow: add the new tokens
        start = find_continuation(packed.tobytes(), self.prompt_lookup_min, self.prompt_lookup_max)
        return [] if start < 0 else list(token_ids[start : start + k])

    def forget(self, request_id: str) -> None:
        """The request is gone: drop its buffer."""
        self._ids.pop(request_id, None)


def check_ngram_settings(num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
    """Raise ValueError unless the proposer's settings make sense (the engine config checks them
    through this too, before any model loads)."""
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
    if not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError(
            "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
            f"{prompt_lookup_min} and {prompt_lookup_max}"
        )


def find_continuation(packed: bytes, min_n: int, max_n: int) -> int:
    """Index of the token after the latest earlier occurrence of the last ``n`` tokens, trying the
    longest ``n`` in [min_n, max_n] first (a longer match predicts better); -1 when none occurs.

    ``packed`` holds the token ids as native ``int32`` (``array("i")``).
    """
    num_tokens = len(packed) // _ITEM
    # An occurrence must end before the last token, so that at least one token follows it.
    limit = (num_tokens - 1) * _ITEM
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        pattern = packed[len(packed) - n * _ITEM :]
        end = limit
        while (pos := packed.rfind(pattern, 0, end)) >= 0:
            if pos % _ITEM == 0:
                return pos // _ITEM + n
            end = pos + len(pattern) - 1  # a match straddling token boundaries: look further back
    return -1

