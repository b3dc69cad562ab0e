"""User text stays text: a special-token string inside caller data never becomes a special token.

A chat template's own markup (``<|im_start|>``, ``<|im_end|>``) must tokenize to special ids, while
the same strings typed by a user must not, or a user can close their turn and open a system turn.
The template is rendered with each special-token string inside caller data swapped for one
private-use placeholder character (chosen to occur nowhere in the input), so every special token
in the rendered text is the template's own. That text is tokenized as usual; only the stretches
between two of the template's special tokens that hold a placeholder are tokenized again, with the
user's strings put back and special-token matching off. The tokenizer splits its input at special
tokens before anything else, so every other stretch — all of them for benign input, where nothing
is swapped — keeps exactly the ids it always had, and a stretch tokenized again gets the ids its
text would get if those strings were not special (BPE merges within it as usual).

Only added tokens flagged special are guarded: non-special added tokens (Qwen's ``<think>``,
``<tool_call>``) are text the template itself reads in content (``'</think>' in content``), so
swapping them would change what benign conversations render to.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import tokenizers

__all__ = ["RenderedChat", "SpecialTokenGuard", "TooManyPrivateUseCharacters"]

# Placeholders come from the supplementary private use planes (15 and 16): no tokenizer gives them
# meaning, and a window of them that the input does not use is always easy to find.
_PRIVATE_FIRST, _PRIVATE_LAST = 0xF0000, 0x10FFFD
_PRIVATE_USE = re.compile("[\U000f0000-\U0010ffff]")


class TooManyPrivateUseCharacters(ValueError):
    """The input uses so many private-use characters that no placeholder window is free."""


class RenderedChat(str):
    """A conversation rendered with its chat template: the prompt text (caller strings as given),
    which also remembers ``marked``, the same text with special-token strings from caller data
    swapped for placeholders, and ``originals`` (placeholder -> the string it stands for).

    A ``str``, so that code that shows, compares or logs rendered text keeps working; anything
    derived from it (a slice, a concatenation) is a plain ``str`` again and tokenizes as template
    text only, with every special-token string parsed."""

    marked: str
    originals: Mapping[str, str]

    def __new__(cls, text: str, marked: str | None = None, originals: Mapping[str, str] | None = None) -> RenderedChat:
        rendered = super().__new__(cls, text)
        rendered.marked = text if marked is None else marked
        rendered.originals = dict(originals or {})
        return rendered


class SpecialTokenGuard:
    """Swaps special-token strings in caller data for placeholders, and tokenizes text rendered
    from such data so that only the template's own special tokens become special ids."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        added = backend.get_added_tokens_decoder()
        self._backend = backend
        self._special = {i: t.content for i, t in added.items() if t.special}
        # Longest first, so a token that extends another (<tts_text_bos_single>) is swapped whole.
        protected = sorted(set(self._special.values()), key=len, reverse=True)
        self._protected = protected
        self._pattern = re.compile("|".join(map(re.escape, protected))) if protected else None
        # A copy that never matches special tokens: for user text (set once, never flipped on a
        # shared tokenizer, since several threads may tokenize at once).
        self.text_backend = tokenizers.Tokenizer.from_str(backend.to_str())
        self.text_backend.encode_special_tokens = True

    # --- caller data -> escaped data ---------------------------------------------------------

    def escape(self, data: Any, avoid: str = "") -> tuple[Any, dict[str, str]]:
        """``data`` (strings, and lists, tuples and dicts of them: keys too) with every special-token
        string swapped for a placeholder, and the placeholders' originals. Data without any such
        string comes back as is, with no placeholders. ``avoid``: more text the placeholders must
        not occur in (the template)."""
        pattern = self._pattern
        if pattern is None:
            return data, {}
        strings = list(_strings(data))
        if not any(pattern.search(s) for s in strings):
            return data, {}
        used = {c for s in [*strings, avoid] for c in _PRIVATE_USE.findall(s)}
        base = self._free_window(used)
        placeholder = {token: chr(base + i) for i, token in enumerate(self._protected)}

        def swap(text: str) -> str:
            return pattern.sub(lambda m: placeholder[m.group()], text)

        return _map_strings(data, swap), {p: token for token, p in placeholder.items()}

    def _free_window(self, used: set[str]) -> int:
        size = len(self._protected)
        base = _PRIVATE_FIRST
        while base + size - 1 <= _PRIVATE_LAST:
            clash = [ord(c) for c in used if base <= ord(c) < base + size]
            if not clash:
                return base
            base = max(clash) + 1
        raise TooManyPrivateUseCharacters("the request uses too many distinct private-use characters")

    @staticmethod
    def restore(text: str, originals: Mapping[str, str]) -> str:
        """``text`` with each placeholder replaced by the string it stands for."""
        if not originals:
            return text
        return text.translate({ord(p): s for p, s in originals.items()})

    # --- tokenizing ----------------------------------------------------------------------------

    def encode(self, rendered: RenderedChat) -> list[int]:
        """Ids of rendered chat text (no post-processor: the template writes any BOS it wants)."""
        # encode_batch releases the GIL (encode does not): see Tokenizer.encode.
        encoding = self._backend.encode_batch([rendered.marked], add_special_tokens=False)[0]
        if not rendered.originals:
            return encoding.ids
        marked = rendered.marked
        ids: list[int] = []
        run: list[int] = []  # the ids of the stretch since the last template special token
        start = 0

        def flush(end: int) -> None:
            stretch = marked[start:end]
            if any(p in stretch for p in rendered.originals):
                text = self.restore(stretch, rendered.originals)
                ids.extend(self.text_backend.encode_batch([text], add_special_tokens=False)[0].ids)
            else:
                ids.extend(run)
            run.clear()

        for token_id, (begin, end) in zip(encoding.ids, encoding.offsets, strict=True):
            content = self._special.get(token_id)
            # A special id whose text is not at its offsets (an unknown-token id for some
            # unencodable stretch) is part of the stretch, not template markup.
            if content is not None and content in marked[begin:end]:
                flush(begin)
                ids.append(token_id)
                start = end
            else:
                run.append(token_id)
        flush(len(marked))
        return ids


def _strings(data: Any) -> Iterator[str]:
    if isinstance(data, str):
        yield data
    elif isinstance(data, Mapping):
        for key, value in data.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(data, (list, tuple)):
        for value in data:
            yield from _strings(value)


def _map_strings(data: Any, swap: Any) -> Any:
    if isinstance(data, str):
        return swap(data)
    if isinstance(data, Mapping):
        return {_map_strings(k, swap): _map_strings(v, swap) for k, v in data.items()}
    if isinstance(data, list):
        return [_map_strings(v, swap) for v in data]
    if isinstance(data, tuple):
        return tuple(_map_strings(v, swap) for v in data)
    return data
