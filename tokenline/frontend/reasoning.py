"""Separate a model's reasoning (`<think>...</think>`) from its answer, streaming or all at once.

The chat template writes reasoning as `<think>\\n{reasoning}\\n</think>\\n\\n{content}`; the newlines
around the tags are layout, not text, so the parser drops them: newlines right after `<think>`,
right before `</think>` and right after `</think>`. Parsing what the template rendered gives back
the message it rendered, and the streamed deltas always add up to `split_reasoning`'s result,
however the text was cut.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "QWEN3",
    "REASONING_FORMATS",
    "THINK_END",
    "THINK_START",
    "ReasoningFormat",
    "ReasoningParser",
    "split_reasoning",
]

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model family's answers hold their thought (vLLM's ``--reasoning-parser`` names).

    Both write ``<think>…</think>``; they differ in where an answer starts. ``qwen3``: inside a
    thought only when the prompt opened ``<think>`` (its template does when thinking is on).
    ``deepseek_r1`` (``starts_in_thought``): DeepSeek-R1's answers are a thought until
    ``</think>`` whether or not the prompt shows the ``<think>`` (its templates put it there, or
    the model writes it), unless the prompt already closed the thought (thinking switched off)."""

    name: str
    starts_in_thought: bool = False


QWEN3 = ReasoningFormat("qwen3")
REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": QWEN3,
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_in_thought=True),
}


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (may still become it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """Incremental splitter of generated text into (reasoning, content) deltas.

    Text outside `<think>...</think>` is content; with no tags at all everything is content. Set
    `starts_in_reasoning` when the output begins inside reasoning (the prompt already opened
    `<think>`): only `</think>` ends it, and a `<think>` the model writes first anyway is dropped.
    A tag split across deltas is held back until it is complete or can no longer be one, so it
    never leaks into either stream.
    """

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._in_reasoning = starts_in_reasoning
        self._saw_reasoning = starts_in_reasoning
        self._held = ""  # text not yet assigned: a possible partial tag, or newlines before one
        # Drop leading newlines of the next text (template layout after a tag).
        self._skip_newlines = starts_in_reasoning
        self._may_reopen = starts_in_reasoning  # the model may open the thought the prompt opened
        self._finished = False

    @property
    def in_reasoning(self) -> bool:
        """Whether the text seen so far ends inside a reasoning block."""
        return self._in_reasoning

    @property
    def saw_reasoning(self) -> bool:
        """Whether any reasoning block was opened (even if it turned out empty)."""
        return self._saw_reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        """Add generated text; return the (reasoning, content) text that is decided now."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        text = self._held + delta
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        # Each pass consumes one tag (or ends the loop), so there are at most len(text) passes.
        for _ in range(len(text) + 1):
            if self._skip_newlines:
                stripped = text.lstrip("\n")
                if not stripped:
                    # All newlines so far: keep skipping with the next delta.
                    return "".join(reasoning), "".join(content)
                text, self._skip_newlines = stripped, False
            if self._may_reopen:
                if THINK_START.startswith(text):
                    self._held = text  # maybe the start of a repeated <think>
                    break
                self._may_reopen = False
                if text.startswith(THINK_START):
                    text, self._skip_newlines = text[len(THINK_START) :], True
                    continue
            tag = THINK_END if self._in_reasoning else THINK_START
            out = reasoning if self._in_reasoning else content
            at = text.find(tag)
            if at >= 0:
                before = text[:at]
                # Newlines before </think> are the template's; before <think> they are content.
                out.append(before.rstrip("\n") if self._in_reasoning else before)
                text = text[at + len(tag) :]
                self._in_reasoning = not self._in_reasoning
                self._saw_reasoning = True
                self._skip_newlines = True
                continue
            hold = _partial_tag_len(text, tag)
            if self._in_reasoning:
                # Trailing newlines may turn out to sit right before </think>: decide later.
                body = text[: len(text) - hold]
                hold += len(body) - len(body.rstrip("\n"))
            out.append(text[: len(text) - hold])
            self._held = text[len(text) - hold :]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: release what was held back (an incomplete tag is plain text)."""
        if self._finished:
            return "", ""
        self._finished = True
        held, self._held = self._held, ""
        if self._in_reasoning:
            # Unterminated reasoning: trailing newlines are dropped as they would be before </think>.
            return held.rstrip("\n"), ""
        return "", held


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """Split a whole output into (reasoning or None when there was no reasoning block, content)."""
    parser = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
    reasoning, content = parser.feed(text)
    tail_reasoning, tail_content = parser.finish()
    if not parser.saw_reasoning:
        return None, content + tail_content
    return reasoning + tail_reasoning, content + tail_content
