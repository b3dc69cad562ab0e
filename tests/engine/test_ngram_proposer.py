"""The n-gram (prompt-lookup) proposer on its own: what it matches and what it proposes."""

from __future__ import annotations

import random

import pytest

from tokenline.spec_decode.ngram_proposer import NgramProposer


def propose(ids: list[int], k: int = 4, min_n: int = 2, max_n: int = 4, max_drafts: int = 100) -> list[int]:
    return NgramProposer(k, min_n, max_n).propose("r", ids, max_drafts)


def test_proposes_what_followed_the_last_ngram() -> None:
    # The last 3 tokens [7, 8, 9] occurred at the start; what followed them is proposed.
    assert propose([7, 8, 9, 10, 11, 12, 13, 1, 7, 8, 9]) == [10, 11, 12, 13]


def test_no_match_proposes_nothing() -> None:
    assert propose([1, 2, 3, 4, 5, 6]) == []
    assert propose([5]) == []
    assert propose([]) == []
    # A single repeated token is below prompt_lookup_min = 2.
    assert propose([1, 9, 2, 9]) == []


def test_prefers_the_longest_ngram_then_the_latest_occurrence() -> None:
    # [3, 4] occurs twice (followed by 50, then by 60); [2, 3, 4] occurs once (followed by 70).
    ids = [2, 3, 4, 70, 0, 3, 4, 50, 0, 3, 4, 60, 0, 2, 3, 4]
    assert propose(ids, k=1) == [70]
    # With only bigrams allowed, the latest earlier occurrence of [3, 4] wins.
    assert propose(ids, k=1, max_n=2) == [60]


def test_proposal_may_run_into_the_suffix_and_stops_at_the_end() -> None:
    # The latest earlier [1, 2] starts two tokens back: only what follows up to the end is proposed.
    assert propose([1, 2, 1, 2, 1, 2], k=4) == [1, 2]


def test_capped_by_k_and_by_max_drafts() -> None:
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert propose(ids, k=4) == [3, 4, 5, 6]
    assert propose(ids, k=2) == [3, 4]
    # The scheduler passes what max_tokens / max_model_len leave as max_drafts.
    assert propose(ids, k=4, max_drafts=1) == [3]
    assert propose(ids, k=4, max_drafts=0) == []


def test_large_ids_and_matches_across_token_boundaries() -> None:
    assert propose([1, 200_000, 248_000, 99, 1, 200_000], k=2) == [248_000, 99]
    # Packed little-endian, [a, b, 0] holds the bytes of [257, 0] at a byte offset of 3: that is not
    # an occurrence. The real one further back is.
    a, b = 0x01000000, 0x00000001
    assert propose([a, b, 0, 5, 257, 0]) == []
    assert propose([257, 0, 42, a, b, 0, 5, 257, 0]) == [42, a, b, 0]


def test_incremental_buffer_follows_the_growing_sequence() -> None:
    proposer = NgramProposer(3, 2, 4)
    ids = [1, 2, 3, 4, 5, 9]
    assert proposer.propose("r", ids, 10) == []
    ids += [1, 2]
    assert proposer.propose("r", ids, 10) == [3, 4, 5]
    ids += [3, 4, 5]
    assert proposer.propose("r", ids, 10) == [9, 1, 2]
    # Another request with its own history; forgetting one leaves the other alone.
    assert proposer.propose("s", [8, 8, 8], 10) == [8]
    proposer.forget("r")
    assert proposer.propose("r", [6, 7, 6, 7], 10) == [6, 7]


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        NgramProposer(0, 2, 4)
    with pytest.raises(ValueError):
        NgramProposer(4, 3, 2)
    with pytest.raises(ValueError):
        NgramProposer(4, 0, 2)


def test_long_sequences_extend_one_buffer() -> None:
    """A step packs only its new tokens and searches with C-level scans: the buffer is extended in
    place, never rebuilt from the whole sequence (the time per call is a benchmark's to report)."""
    rng = random.Random(0)
    proposer = NgramProposer(4, 2, 4)
    ids = [rng.randrange(49152) for _ in range(8000)]
    proposer.propose("r", ids, 4)
    packed = proposer._ids["r"]
    for _ in range(200):
        ids.append(rng.randrange(49152))
        proposer.propose("r", ids, 4)
        assert proposer._ids["r"] is packed and len(packed) == len(ids)
    assert list(packed) == ids
    ids.extend(ids[100:104])  # a repeated 4-gram is found at the end of a long sequence
    assert proposer.propose("r", ids, 4) == ids[104:108]