"""The suffix-tree proposer: the tree holds exactly the substring counts of its sequence (built
whole or token by token), drafts follow the most frequent continuation of the longest earlier
match, their length adapts to the match and the branch probabilities, and the acceptance and load
gates shrink them."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenline.spec_decode.suffix_proposer import SuffixProposer, SuffixTree, check_suffix_settings


def brute_counts(tokens: list[int], depth: int) -> dict[tuple[int, ...], int]:
    counts: Counter[tuple[int, ...]] = Counter()
    for start in range(len(tokens)):
        for length in range(1, min(depth, len(tokens) - start) + 1):
            counts[tuple(tokens[start : start + length])] += 1
    return dict(counts)


@pytest.mark.parametrize("seed", range(60))
def test_tree_holds_every_substring_count_built_whole_or_token_by_token(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(2, 9)
    tokens = [rng.randrange(rng.choice([2, 3, 6, 40])) for _ in range(rng.randint(1, 90))]
    whole = SuffixTree(depth)
    whole.extend(tokens)
    incremental = SuffixTree(depth)
    for i in range(0, len(tokens), 3):  # as decoding adds them: a few at a time
        incremental.extend(tokens[i : i + 3])
    assert dict(whole.substring_counts()) == brute_counts(tokens, depth)
    assert dict(incremental.substring_counts()) == dict(whole.substring_counts())
    assert incremental.num_nodes == whole.num_nodes


def test_nodes_grow_with_the_text_not_with_text_times_depth() -> None:
    """Unique tails stay references into the token list: a random text needs about one node per
    token however deep the tree; repeated text pays for its repeats only."""
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(3000)]
    for depth in (8, 24, 64):
        tree = SuffixTree(depth)
        tree.extend(tokens)
        assert tree.num_nodes < 1.1 * len(tokens)
    copied = SuffixTree(24)
    copied.extend(tokens[:1000] + tokens[:1000])
    assert copied.num_nodes < 1000 * 24 + 2000


def test_drafts_the_most_frequent_continuation_of_the_longest_match() -> None:
    # "1 2 3" was followed by 4 twice and by 9 once: 4 wins (a latest-occurrence lookup says 9).
    proposer = SuffixProposer(num_speculative_tokens=8, max_tree_depth=24)
    seq = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 9, 7, 1, 2, 3]
    assert proposer.propose("a", seq, 8) == [4, 5, 6]  # match 3: at most 3 drafts
    # The longer match "0 1 2 3" was only ever followed by 9: it decides, and drafts 4 tokens.
    assert proposer.propose("b", seq[:-4] + [0, 1, 2, 3], 8) == [9, 0, 1, 2]
    assert proposer.propose("c", [5, 6, 7, 8], 8) == []  # nothing occurred before


def test_draft_length_adapts_to_the_match_and_stops_at_uncertain_branches() -> None:
    passage = list(range(100, 140))
    seq = passage + [1, 2] + passage[:10]
    # A 10-token match drafts 10 tokens of the copy (the cap of 16 is not the limit).
    proposer = SuffixProposer(num_speculative_tokens=16, max_tree_depth=32)
    assert proposer.propose("r", seq, 16) == passage[10:20]
    half = SuffixProposer(num_speculative_tokens=16, max_tree_depth=32, max_spec_factor=0.5)
    assert half.propose("r", seq, 16) == passage[10:15]
    assert proposer.propose("s", seq, 3) == passage[10:13]  # the scheduler's room caps it too
    # "5 7" was followed by 1, 2, 3 and 4 once each: no continuation reaches probability 0.3...
    branchy = [5, 7, 1, 5, 7, 2, 5, 7, 3, 5, 7, 4, 5, 7]
    assert SuffixProposer(4, min_token_prob=0.3).propose("b", branchy, 4) == []
    # ... but 0.25 is enough, and past the branch the one occurrence goes on (2 = the match length).
    drafts = SuffixProposer(4, min_token_prob=0.25).propose("b", branchy, 4)
    assert len(drafts) == 2 and drafts[0] in (1, 2, 3, 4) and drafts[1] == 5
    # A one-token match never drafts: "9" occurred before, but alone it predicts too little.
    assert SuffixProposer(4).propose("o", [9, 8, 6, 9], 4) == []


def test_rejections_stop_the_drafts_and_they_come_back() -> None:
    proposer = SuffixProposer(num_speculative_tokens=4, min_token_prob=0.1)
    seq = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]
    assert proposer.propose("r", seq, 4) == [5, 6, 1, 2]
    proposer.record("r", 4, 2)  # half accepted: half as many drafts
    assert proposer.propose("r", seq, 4) == [5, 6, 1]
    for _ in range(10):
        proposer.record("r", 4, 0)
    assert proposer.propose("r", seq, 4) == []  # paused
    drafted_again = next((step for step in range(200) if proposer.propose("r", seq, 4)), None)
    assert drafted_again is not None and drafted_again > 10  # undrafted steps restore it slowly
    assert len(proposer.propose("r", seq, 4)) == 1  # and it starts again with short drafts
    proposer.forget("r")
    assert proposer.propose("r", seq, 4) == [5, 6, 1, 2]


def test_a_full_batch_needs_surer_drafts() -> None:
    # "1 2 3" continued with 4 twice and 9 once: 4 has probability 2/3.
    seq = [5, 1, 2, 3, 4, 0, 6, 1, 2, 3, 4, 0, 8, 1, 2, 3, 9, 0, 7, 1, 2, 3]
    proposer = SuffixProposer(num_speculative_tokens=2, min_token_prob=0.1, full_load_seqs=16)
    proposer.begin_step(1)
    assert proposer.propose("r", seq, 2) == [4, 0]
    proposer.begin_step(32)  # the bar is 0.9 now
    assert proposer.propose("r", seq, 2) == []
    copy = list(range(10, 30)) + list(range(10, 20))  # one earlier occurrence: probability 1
    assert proposer.propose("c", copy, 2) == [20, 21]


def test_a_decode_step_adds_bounded_work_to_the_tree() -> None:
    """The cost a decode step adds is one token into the existing tree (at most one step per
    growing suffix) and one lookup: never a rebuild. Behaviour, not a clock: the per-step time is
    bench/spec_real_work.py's to report."""
    rng = random.Random(1)
    text = [rng.randrange(30_000) for _ in range(1500)]
    proposer = SuffixProposer(num_speculative_tokens=8)
    seq = text + text[:50]
    proposer.propose("r", seq, 8)
    tree = proposer._trees["r"]
    for i in range(50, 550):
        seq.append(text[i])
        nodes_before = tree.num_nodes
        proposer.propose("r", seq, 8)
        assert proposer._trees["r"] is tree  # extended in place
        assert len(tree.tokens) == len(seq)
        assert tree.num_nodes - nodes_before <= 2 * tree.max_depth  # a new node per suffix at most
        assert len(tree._cursors) < tree.max_depth  # only suffixes shorter than the depth grow
    proposer.propose("r", seq[:10], 8)  # a shorter sequence is another sequence: rebuilt
    assert proposer._trees["r"] is not tree


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        check_suffix_settings(0, 24, 1.0, 0.1)
    with pytest.raises(ValueError, match="max_tree_depth"):
        check_suffix_settings(4, 1, 1.0, 0.1)
    with pytest.raises(ValueError, match="max_spec_factor"):
        check_suffix_settings(4, 24, 0.0, 0.1)
    with pytest.raises(ValueError, match="min_token_prob"):
        check_suffix_settings(4, 24, 1.0, 1.5)
