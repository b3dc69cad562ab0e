"""One sequence's generated ids in, its text deltas out: incremental detokenization plus stop strings.

The offline ``LLM`` and the server both turn engine outputs into text through this one class.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenline.frontend.detokenizer import IncrementalDetokenizer
from tokenline.frontend.stop_strings import StopStringMatcher
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.sampling_params import SamplingParams


class TextStream:
    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int] | None = None
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, prompt_token_ids)
        self._matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.text = ""

    @property
    def stopped(self) -> bool:
        """True once a stop string ended the text; the caller then aborts the sequence."""
        return self._matcher is not None and self._matcher.stopped

    @property
    def stop_string(self) -> str | None:
        return self._matcher.matched if self._matcher is not None else None

    @property
    def holds_partial_character(self) -> bool:
        """The detokenizer holds ids back: they end in an unfinished UTF-8 character."""
        return self._detokenizer.holds_partial_character

    @property
    def decoded_chars(self) -> int:
        """Characters the ids pushed so far decode to (``text`` is a prefix of that text: a stop
        string cuts it, a possible one holds its tail back)."""
        return self._detokenizer.emitted_chars

    @property
    def held_stop_prefix(self) -> str:
        """Text held back because it may begin a stop string."""
        return self._matcher.held if self._matcher is not None else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new ids; return the text that may be shown now."""
        if self.stopped:
            return ""
        return self._emit(self._detokenizer.push(token_ids))

    def finish(self) -> str:
        """Generation ended: release whatever was held back (a partial character, a near stop)."""
        if self.stopped:
            return ""
        delta = self._emit(self._detokenizer.flush())
        if self._matcher is not None and not self._matcher.stopped:
            tail = self._matcher.flush()
            self.text += tail
            delta += tail
        return delta

    def _emit(self, delta: str) -> str:
        if self._matcher is not None:
            delta, _ = self._matcher.feed(delta)
        self.text += delta
        return delta
