"""Suffix-tree drafting for speculative decoding, like vLLM's ``suffix`` method (Arctic's Suffix Decoding).

Each request keeps a suffix tree of its own tokens (prompt, then every token it accepts), cut at
``max_depth`` tokens: the node for a substring counts how often it occurs. To draft, the proposer
finds the longest suffix of the sequence that occurred before, then walks down the tree taking the
most frequent child each time, for as long as the estimated probability of the whole draft (the
product of child count / sibling counts) stays above ``min_token_prob``. The draft is at most
``max_spec_factor`` × the match length long: a long match predicts further than a short one.

Unlike prompt lookup (ngram_proposer.py), which copies after the *latest* occurrence of a fixed
n-gram, this votes across all earlier occurrences and stops at branches where they disagree, so it
drafts long runs where the context is copied and little where it is merely similar.

Two gates keep wrong guesses cheap: a per-request acceptance rate (an exponential average) shortens
the drafts and scales the probability estimate, so a request whose drafts keep failing stops
drafting (and probes again after a while), and the probability a draft token needs rises with the number of running decodes,
because at a large batch the step is compute-bound and every rejected row costs real time.

The tree is path-compressed at its tails: a node only one suffix passes through keeps the rest of
that suffix as a reference into the token list instead of nodes, so a random text costs O(length)
nodes, not O(length × depth); repeated substrings cost a node each. Appending a token touches each
of the at most ``max_depth`` suffixes still growing once: O(depth) per decoded token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

# Acceptance-rate average (accepted / drafted per verified step): weight of the newest step. Below
# _PAUSE_BELOW a request stops drafting; each step it sits out adds _RECOVERY, so it tries again
# some 20 steps later (what the text does may have changed).
_ACCEPT_EMA = 0.3
_PAUSE_BELOW = 0.2
_RECOVERY = 0.01
# Shortest match that drafts: one token that occurred once before predicts little (the ngram
# proposer's default minimum is 2 as well).
_MIN_MATCH = 2
# The probability a draft token needs at full load (a rejected row then costs nearly a token).
_FULL_LOAD_MIN_PROB = 0.9


class _Node:
    """A substring of the sequence: how many suffixes pass through it, its children by next token,
    and for a node one suffix owns, the rest of that suffix as ``tail`` tokens from ``ref``."""

    __slots__ = ("count", "children", "owner", "ref", "tail")

    def __init__(self, owner: int = -1, ref: int = 0) -> None:
        self.count = 1
        self.children: dict[int, _Node] | None = None
        self.owner = owner  # start of the one suffix through here (count == 1), else -1
        self.ref = ref  # index in the token list of the first implicit tail token
        self.tail = 0  # implicit tokens below this node (owned nodes only)


class SuffixTree:
    """All substrings of one token sequence up to ``max_depth`` tokens, with their counts."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be at least 2, got {max_depth}")
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self.root = _Node()
        self.root.count = 0
        self.num_nodes = 1
        # Suffixes still shorter than max_depth: their start -> the deepest node of their path.
        self._cursors: dict[int, _Node] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            self.append(token_id)

    def append(self, token_id: int) -> None:
        """Add one token: every growing suffix takes one step down, and a new one starts at the root."""
        t = len(self.tokens)
        self.tokens.append(token_id)
        cursors = self._cursors
        cursors[t] = self.root
        for start in list(cursors):
            cursors[start] = self._step(cursors[start], token_id, start, t)
            if t - start + 1 >= self.max_depth:
                del cursors[start]

    def _step(self, node: _Node, token_id: int, start: int, t: int) -> _Node:
        if node.owner == start:  # the suffix's own implicit tail: it just gets one longer
            node.tail += 1
            return node
        if node.children is None:
            node.children = {}
        child = node.children.get(token_id)
        if child is None:
            node.children[token_id] = child = _Node(owner=start, ref=t + 1)
            self.num_nodes += 1
            return child
        if child.owner >= 0:
            self._share(child)
        child.count += 1
        return child

    def _share(self, node: _Node) -> None:
        """A second suffix enters an owned node: its tail's first token becomes a real child."""
        owner, node.owner = node.owner, -1
        if node.tail:
            below = _Node(owner=owner, ref=node.ref + 1)
            below.tail = node.tail - 1
            node.children = {self.tokens[node.ref]: below}
            node.tail = 0
            self.num_nodes += 1
            if self._cursors.get(owner) is node:
                self._cursors[owner] = below

    def find(self, length: int) -> _Node | None:
        """The node of the sequence's last ``length`` tokens if they occurred before (count >= 2)."""
        node: _Node | None = self.root
        for token_id in self.tokens[len(self.tokens) - length :]:
            children = node.children
            node = children.get(token_id) if children else None
            if node is None or node.count < 2:  # counts only shrink going down
                return None
        return node

    def longest_match(self, max_length: int) -> tuple[int, _Node | None]:
        """The longest suffix (at most ``max_length`` tokens) that occurred before, and its node.

        If the last m tokens occurred twice, so did the last m - 1: a binary search over m."""
        lo, hi, best = 1, min(max_length, len(self.tokens) - 1, self.max_depth - 1), None
        found = 0
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.find(mid)
            if node is None:
                hi = mid - 1
            else:
                found, best, lo = mid, node, mid + 1
        return found, best

    def continuation(self, node: _Node, max_tokens: int, min_prob: float) -> list[int]:
        """The most frequent path below ``node``: at most ``max_tokens``, while the product of the
        choices' probabilities stays at or above ``min_prob``."""
        draft: list[int] = []
        prob = 1.0
        while len(draft) < max_tokens:
            if node.owner >= 0:  # one suffix from here on: its tokens, no further choice
                end = node.ref + min(node.tail, max_tokens - len(draft))
                draft.extend(self.tokens[node.ref : end])
                break
            if not node.children:
                break
            total = 0
            best_token, best = -1, node
            for token_id, child in node.children.items():
                total += child.count
                if best is node or child.count > best.count:
                    best_token, best = token_id, child
            prob *= best.count / total
            if prob < min_prob:
                break
            draft.append(best_token)
            node = best
        return draft

    def substring_counts(self) -> Iterator[tuple[tuple[int, ...], int]]:
        """Every stored substring with its count, implicit tails included (for tests and debugging)."""
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            if path:
                yield path, node.count
            if node.owner >= 0:
                for i in range(node.tail):
                    yield path + tuple(self.tokens[node.ref : node.ref + i + 1]), 1
            for token_id, child in (node.children or {}).items():
                stack.append((child, path + (token_id,)))


class SuffixProposer:
    """Drafts by suffix-tree lookup over each request's own tokens, gated by acceptance and load."""

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        full_load_seqs: int = 16,
    ) -> None:
        check_suffix_settings(num_speculative_tokens, max_tree_depth, max_spec_factor, min_token_prob)
        self.num_speculative_tokens = num_speculative_tokens
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.full_load_seqs = max(2, full_load_seqs)
        self._trees: dict[str, SuffixTree] = {}
        self._accept_rate: dict[str, float] = {}
        self._step_min_prob = min_token_prob
        # The match may use only the depth a draft leaves free, so a long match can still draft.
        self._max_match = max(1, max_tree_depth - num_speculative_tokens)

    def begin_step(self, num_decoding: int) -> None:
        """The scheduler is about to draft for ``num_decoding`` requests: set the step's bar.

        It rises linearly from ``min_token_prob`` at one decode to 0.9 at ``full_load_seqs``:
        a lone decode is bound by the weight reads, so extra rows are nearly free, while a full
        batch is compute-bound and a rejected row costs about what a plain token does."""
        load = min(1.0, max(0, num_decoding - 1) / (self.full_load_seqs - 1))
        self._step_min_prob = self.min_token_prob + (_FULL_LOAD_MIN_PROB - self.min_token_prob) * load

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Draft tokens to follow ``token_ids`` (at most ``max_drafts``; often none)."""
        tree = self._trees.get(request_id)
        if tree is None or len(tree.tokens) > len(token_ids):
            tree = self._trees[request_id] = SuffixTree(self.max_tree_depth)
        tree.extend(token_ids[len(tree.tokens) :])  # sequences only grow: add the new tokens
        limit = min(self.num_speculative_tokens, max_drafts)
        if limit <= 0:
            return []
        rate = self._accept_rate.get(request_id, 1.0)
        if rate < _PAUSE_BELOW:
            self._accept_rate[request_id] = rate + _RECOVERY
            return []
        match, node = tree.longest_match(self._max_match)
        if node is None or match < _MIN_MATCH:
            return []
        # Longer matches draft further; a request whose drafts get cut short drafts shorter, and
        # needs a surer guess (its rate scales the tree's estimate).
        limit = min(limit, max(1, int(self.max_spec_factor * match)), max(1, round(limit * rate)))
        return tree.continuation(node, limit, self._step_min_prob / rate)

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """How many of the request's last drafts the model agreed with."""
        if num_drafted > 0:
            rate = self._accept_rate.get(request_id, 1.0)
            self._accept_rate[request_id] = rate + _ACCEPT_EMA * (num_accepted / num_drafted - rate)

    def forget(self, request_id: str) -> None:
        """The request is gone: drop its tree."""
        self._trees.pop(request_id, None)
        self._accept_rate.pop(request_id, None)


def check_suffix_settings(num_speculative_tokens: int, max_tree_depth: int, max_spec_factor: float,
                          min_token_prob: float) -> None:
    """Raise ValueError unless the suffix proposer's settings make sense (the engine config checks
    them through this too, before any model loads)."""
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
    if max_tree_depth < 2:
        raise ValueError(f"suffix_decoding_max_tree_depth must be at least 2, got {max_tree_depth}")
    if max_spec_factor <= 0:
        raise ValueError(f"suffix_decoding_max_spec_factor must be positive, got {max_spec_factor}")
    if not 0.0 <= min_token_prob <= 1.0:
        raise ValueError(f"suffix_decoding_min_token_prob must be in [0, 1], got {min_token_prob}")
