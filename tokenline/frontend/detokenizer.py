"""Incremental detokenization: turn a stream of generated token ids into text deltas.

Byte-level vocabularies split one character (an emoji, most CJK) over several tokens, and
decoding such a token alone gives U+FFFD. `tokenizers.decoders.DecodeStream` decodes a short
window of recent ids and only releases text once it no longer ends in an incomplete character,
so a split character is emitted once, whole. If DecodeStream ever rejects a step (it raises when
a decoder rewrites text already emitted), we fall back to decoding the whole output each step.

The prompt's last tokens are decoding context. DecodeStream mishandles a context whose text holds
an unfinished character (it then emits the context itself with the first output text), which a
token-id prompt can end in; such a prompt takes the whole-output path from the start.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from tokenline.frontend.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens used as decoding context: enough for decoders whose output depends on the previous
# token (SentencePiece's leading-space handling), few enough to keep the first step cheap. A tail
# that starts inside a character (an emoji's last bytes) is widened, up to the second figure.
_PROMPT_CONTEXT_TOKENS = 4
_MAX_PROMPT_CONTEXT_TOKENS = 24
_REPLACEMENT = "\ufffd"


def _prompt_context(tokenizer: Tokenizer, prompt_token_ids: Sequence[int] | None,
                    skip_special_tokens: bool) -> tuple[list[int], str, bool]:
    """The prompt tail to decode with the output, its text, and whether that text is whole (no
    U+FFFD): the shortest tail of at least ``_PROMPT_CONTEXT_TOKENS`` ids that decodes cleanly, else
    the shortest tail and False."""
    if not prompt_token_ids:
        return [], "", True
    decode = tokenizer.backend.decode
    longest = min(len(prompt_token_ids), _MAX_PROMPT_CONTEXT_TOKENS)
    shortest: tuple[list[int], str] | None = None
    for n in range(min(_PROMPT_CONTEXT_TOKENS, longest), longest + 1):
        tail = list(prompt_token_ids[-n:])
        text = decode(tail, skip_special_tokens=skip_special_tokens)
        if _REPLACEMENT not in text:
            return tail, text, True
        shortest = shortest or (tail, text)
    assert shortest is not None  # the loop ran at least once: the prompt is not empty
    return *shortest, False


class IncrementalDetokenizer:
    """Text deltas for one request's generated ids.

    The concatenation of every `push` delta and the final `flush` equals the decoding of all
    generated ids (with the last prompt tokens as context, see `prompt_token_ids`); a delta
    never ends in a partial character.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Context ids are decoded with the output but never emitted: for SentencePiece a first
        # generated "▁Hello" is " Hello" after a prompt, and "Hello" at the start of a text.
        self._context, self._context_text, whole = _prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stream: DecodeStream | None = (
            DecodeStream(self._context or None, skip_special_tokens=self._skip) if whole else None
        )
        self._token_ids: list[int] = []
        self._emitted_chars = 0
        self._pending = False  # ids pushed whose text is held back (an unfinished character)
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far."""
        return self._token_ids

    @property
    def holds_partial_character(self) -> bool:
        """Ids pushed whose text is held back: they end in an unfinished character (read-only, for traces)."""
        return self._pending and not self._finished

    @property
    def emitted_chars(self) -> int:
        """Characters of text released so far (the length of every delta together)."""
        return self._emitted_chars

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (may be "")."""
        if self._finished:
            raise RuntimeError("push() after flush()")
        self._token_ids.extend(token_ids)
        if self._stream is None:
            return self._slow_delta(final=False)
        pieces: list[str] = []
        for i, token_id in enumerate(token_ids):
            try:
                piece = self._stream.step(self._tokenizer.backend, token_id)
            except Exception:
                # DecodeStream refuses when the window's text no longer starts with what it
                # already emitted. Decoding the whole output is slower but always consistent.
                self._stream = None
                self._emitted_chars += sum(map(len, pieces))
                return "".join(pieces) + self._slow_delta(final=False)
            if piece is None:
                self._pending = True
            else:
                self._pending = False
                pieces.append(piece)
        delta = "".join(pieces)
        self._emitted_chars += len(delta)
        return delta

    def flush(self) -> str:
        """Call once when generation ends: return text still held back (an unfinished character).

        The tail is what a full decode shows for those bytes (U+FFFD), so the concatenation of
        all deltas still equals `decode(all ids)`.
        """
        if self._finished:
            return ""
        self._finished = True
        if self._stream is not None and not self._pending:
            return ""
        return self._slow_delta(final=True)

    def _full_text(self) -> str:
        """Decoding of all generated ids, in the context of the prompt tail."""
        text = self._tokenizer.backend.decode(self._context + self._token_ids, skip_special_tokens=self._skip)
        # Where the output's first bytes finish the prompt's last character, that character
        # belongs to the output; the rest of the prompt's text never does.
        return text[len(os.path.commonprefix([self._context_text, text])) :]

    def _slow_delta(self, final: bool) -> str:
        text = self._full_text()
        self._pending = not final and text.endswith(_REPLACEMENT)
        if self._pending:
            # Possibly an unfinished character: wait for the next id (flush releases it if not).
            return ""
        delta = text[self._emitted_chars :]
        self._emitted_chars = max(self._emitted_chars, len(text))
        return delta
