"""Safety filters at the gateway: whether a request's text (input) and its generated text (output)
are allowed, per tenant, before and while the engine works.

A filter is anything with ``check_input`` and ``check_output`` (``ContentFilter``); two are built
in: ``BlocklistFilter`` (case-insensitive words and regexes, compiled once) and
``ModerationFilter`` (a client for any service in OpenAI's ``/v1/moderations`` shape). Both are
described by the same tables, in a ``--content-filter`` file or in a tenant of the keys file::

    [[content_filter]]
    type = "blocklist"
    name = "house-words"              # label in metrics, traces and the ledger (default: the type)
    words = ["xylophone"]             # whole words, any case
    patterns = ['\\bcard\\s*\\d{4}']  # regexes, any case
    stages = ["input", "output"]      # the default

    [[content_filter]]
    type = "moderation"
    url = "https://api.openai.com/v1/moderations"
    model = "omni-moderation-latest"
    api_key_env = "OPENAI_API_KEY"    # read when a check runs; never stored in the file
    timeout_s = 2.0
    on_error = "block"                # the default: an unreachable service refuses (fail-closed)
    categories = ["violence"]         # block only these (default: the service's `flagged`)

Output is checked incrementally on the text deltas of each choice: ``check_output(text, start,
final)`` gets the choice's text so far, where the new delta begins and whether the text ended, so
a filter scans only a bounded window around the new text. What a check passes is let out but its
last ``holdback`` characters (``OutputGuard``; by default each filter's own ``holdback``: a
blocklist's longest word less one), so a listed word is never streamed in part; the tokens of text
a filter cut never leave the server (``SequenceState.cut``).
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx

__all__ = [
    "STAGES",
    "VERDICTS",
    "BlocklistFilter",
    "ContentFilter",
    "Decision",
    "FilterConfigError",
    "ModerationFilter",
    "OutputGuard",
    "load_filter_file",
    "parse_filters",
]

STAGES = ("input", "output")
VERDICTS = ("allow", "block", "error")  # error: the filter could not decide; its on_error policy ruled


@dataclass(frozen=True)
class Decision:
    """One filter's verdict on one check. ``blocked`` says whether the request (or the choice's
    output) ends here: a block, or an error under a fail-closed policy."""

    filter: str
    verdict: str  # one of VERDICTS
    blocked: bool
    reason: str | None = None  # why, never the user's text: "word", "pattern", categories, the error
    offset: int | None = None  # output: where the flagged text begins (None: at the new delta)


@runtime_checkable
class ContentFilter(Protocol):
    name: str
    stages: frozenset[str]
    # Characters of output to hold back so that text this filter would flag is never shown in
    # part before the check that flags it (0: the filter judges text only as a whole window).
    holdback: int

    async def check_input(self, texts: Sequence[str]) -> Decision: ...

    async def check_output(self, text: str, start: int, final: bool) -> Decision: ...


class FilterConfigError(ValueError):
    """A content filter table is wrong; the message says where."""


# ------------------------------------------------------------------------------------- blocklist


class BlocklistFilter:
    """Listed words (whole words, any case) and regexes (any case), each compiled once.

    Output is scanned from ``window`` characters before the new delta, so a word split across
    deltas is still found; ``window`` covers the longest word, and is the longest span a pattern
    may match across deltas (``pattern_window``). A word at the very end of a delta counts as a
    match at once: waiting for the next character would show it to a streaming client first.
    """

    def __init__(
        self,
        name: str,
        words: Sequence[str] = (),
        patterns: Sequence[str] = (),
        stages: Sequence[str] = STAGES,
        pattern_window: int = 256,
    ) -> None:
        self.name = name
        self.stages = frozenset(stages)
        self._words = (
            re.compile("|".join(rf"(?<!\w){re.escape(w)}(?!\w)" for w in words), re.IGNORECASE) if words else None
        )
        self._patterns = [re.compile(p, re.IGNORECASE) for p in patterns]
        longest = max((len(w) for w in words), default=0)
        self.window = max(longest, pattern_window if patterns else 0) + 1  # +1: the char a lookbehind reads
        # A word is flagged as soon as its last character arrives: what may come before that is
        # at most its first len - 1 characters. Patterns have no length to hold back for.
        self.holdback = max(0, longest - 1)

    def _find(self, text: str, pos: int) -> tuple[str, int] | None:
        if self._words is not None and (m := self._words.search(text, pos)):
            return "word", m.start()
        for pattern in self._patterns:
            if m := pattern.search(text, pos):
                return "pattern", m.start()
        return None

    async def check_input(self, texts: Sequence[str]) -> Decision:
        for text in texts:
            if found := self._find(text, 0):
                return Decision(self.name, "block", True, found[0])
        return Decision(self.name, "allow", False)

    async def check_output(self, text: str, start: int, final: bool) -> Decision:
        found = self._find(text, max(0, start - self.window))
        if found is None:
            return Decision(self.name, "allow", False)
        return Decision(self.name, "block", True, found[0], offset=found[1])


# ------------------------------------------------------------------------------------ moderation


class ModerationError(Exception):
    """The moderation service did not give a usable answer."""


class ModerationFilter:
    """A client for a moderation service in OpenAI's shape: ``POST {input: [texts], model}`` →
    ``{results: [{flagged, categories: {name: bool}}]}``; flagged when any result is (or, with
    ``categories``, when any of those is true).

    Output is sent in windows, not per delta: once every ``output_chars`` new characters and when
    the text ends, the text since the previous check plus ``overlap_chars`` before it.
    """

    def __init__(
        self,
        name: str,
        url: str,
        model: str | None = None,
        api_key_env: str | None = None,
        timeout_s: float = 2.0,
        on_error: str = "block",
        categories: Sequence[str] | None = None,
        stages: Sequence[str] = STAGES,
        output_chars: int = 400,
        overlap_chars: int = 100,
    ) -> None:
        self.name = name
        self.url = url
        self.model = model
        self.api_key_env = api_key_env
        self.timeout_s = timeout_s
        self.fail_closed = on_error == "block"
        self.categories = frozenset(categories) if categories is not None else None
        self.stages = frozenset(stages)
        self.output_chars = output_chars
        self.overlap_chars = overlap_chars
        self.holdback = 0  # judged in windows of output_chars; see docs/operate/safety.md on holding those back
        self._client: httpx.AsyncClient | None = None  # made on first use, inside the event loop

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _flagged(self, texts: list[str]) -> list[str] | None:
        """The categories (or ``["flagged"]``) that flag ``texts``; None when nothing does."""
        headers = {}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ModerationError(f"${self.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        body: dict[str, Any] = {"input": texts}
        if self.model:
            body["model"] = self.model
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        try:
            response = await self._client.post(self.url, json=body, headers=headers)
        except httpx.TimeoutException:
            raise ModerationError(f"no answer within {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise ModerationError(f"unreachable: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise ModerationError(f"HTTP {response.status_code}")
        try:
            results = response.json()["results"]
            hits: list[str] = []
            for result in results:
                named = result.get("categories") or {}
                if self.categories is not None:
                    hits += [c for c in sorted(self.categories) if named.get(c) is True]
                elif result["flagged"] is True:
                    hits += [c for c, on in named.items() if on is True] or ["flagged"]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModerationError("the answer is not in the /v1/moderations shape") from None
        if not isinstance(results, list) or len(results) != len(texts):
            raise ModerationError("the answer has a result count that does not match the inputs")
        return sorted(set(hits)) or None

    async def _decide(self, texts: list[str]) -> Decision:
        try:
            hits = await self._flagged(texts)
        except ModerationError as exc:
            return Decision(self.name, "error", self.fail_closed, f"moderation service: {exc}")
        if hits:
            return Decision(self.name, "block", True, ",".join(hits))
        return Decision(self.name, "allow", False)

    async def check_input(self, texts: Sequence[str]) -> Decision:
        texts = [t for t in texts if t]
        return await self._decide(texts) if texts else Decision(self.name, "allow", False)

    async def check_output(self, text: str, start: int, final: bool) -> Decision:
        # Checks fall where the text crosses a multiple of output_chars (and at its end); the
        # window reaches back to the previous such multiple, so no text goes unchecked.
        chunk = self.output_chars
        last_mark = (start // chunk) * chunk
        if not final and len(text) < last_mark + chunk:
            return Decision(self.name, "allow", False)
        window = text[max(0, last_mark - self.overlap_chars) :]
        return await self._decide([window]) if window.strip() else Decision(self.name, "allow", False)


# ------------------------------------------------------------------------------- one request's use


class OutputGuard:
    """The output filters of one request, over each of its choices as the text grows.

    Each filter's verdict on a choice is reported once — its block, or its last verdict when the
    text ends — plus any error it met on the way (a fail-open error lets the text go on).
    ``holdback``: characters of checked text kept back until more text (or the end) comes; None
    takes the largest of the filters' own.
    """

    def __init__(
        self, filters: Sequence[ContentFilter], report: Callable[[Decision], None], holdback: int | None = None
    ) -> None:
        self.filters = tuple(filters)
        self.holdback = max((f.holdback for f in self.filters), default=0) if holdback is None else holdback
        self._report = report
        self._done: set[str] = set()  # choices whose text ended or was cut

    async def check(self, choice: str, text: str, start: int, final: bool) -> Decision | None:
        """The decision that ends ``choice``'s text, if any: ``text`` is all of it so far, the new
        delta begins at ``start``, ``final`` says the text ended."""
        if choice in self._done:
            return None
        decisions = []
        for f in self.filters:
            decision = await f.check_output(text, start, final)
            if decision.blocked:
                self._done.add(choice)
                self._report(decision)
                return decision
            decisions.append(decision)
        for decision in decisions:
            if final or decision.verdict == "error":
                self._report(decision)
        if final:
            self._done.add(choice)
        return None


# ---------------------------------------------------------------------------------- configuration


_COMMON = {"type", "name", "stages"}
_FIELDS = {
    "blocklist": _COMMON | {"words", "patterns", "pattern_window"},
    "moderation": _COMMON
    | {"url", "model", "api_key_env", "timeout_s", "on_error", "categories", "output_chars", "overlap_chars"},
}


def _strings(where: str, key: str, value: Any, *, non_empty: bool = False) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise FilterConfigError(f"{where}: {key} must be a list of non-empty strings")
    if non_empty and not value:
        raise FilterConfigError(f"{where}: {key} must not be empty")
    return value


def _positive(where: str, key: str, value: Any, kind: type = int) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise FilterConfigError(f"{where}: {key} must be a positive {'number' if kind is float else 'integer'}")
    if not (math.isfinite(value) and value > 0):
        raise FilterConfigError(f"{where}: {key} must be a positive {'number' if kind is float else 'integer'}")
    return value


def _parse_one(where: str, table: Any) -> ContentFilter:
    if not isinstance(table, Mapping):
        raise FilterConfigError(f"{where}: must be a table")
    kind = table.get("type")
    if kind not in _FIELDS:
        raise FilterConfigError(f"{where}: type must be one of {', '.join(sorted(_FIELDS))}, got {kind!r}")
    unknown = sorted(set(table) - _FIELDS[kind])
    if unknown:
        raise FilterConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_FIELDS[kind]))}")
    name = table.get("name", kind)
    # Names are metric labels and ledger values: kept to characters that need no quoting.
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}", name):
        raise FilterConfigError(f"{where}: name must be 1-64 characters of A-Z a-z 0-9 _ . -, got {name!r}")
    where = f"{where} ({name!r})"
    stages = _strings(where, "stages", table.get("stages", list(STAGES)), non_empty=True)
    if not set(stages) <= set(STAGES):
        raise FilterConfigError(f"{where}: stages must be a subset of {list(STAGES)}")
    if kind == "blocklist":
        words = _strings(where, "words", table.get("words", []))
        patterns = _strings(where, "patterns", table.get("patterns", []))
        if not words and not patterns:
            raise FilterConfigError(f"{where}: a blocklist needs words or patterns")
        for i, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise FilterConfigError(f"{where}: patterns[{i}] is not a valid regex: {exc}") from None
        window = _positive(where, "pattern_window", table.get("pattern_window", 256))
        return BlocklistFilter(name, words, patterns, stages, window)
    url = table.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise FilterConfigError(f"{where}: url must be an http:// or https:// URL")
    for key in ("model", "api_key_env"):
        if key in table and (not isinstance(table[key], str) or not table[key]):
            raise FilterConfigError(f"{where}: {key} must be a non-empty string")
    on_error = table.get("on_error", "block")
    if on_error not in ("block", "allow"):
        raise FilterConfigError(f"{where}: on_error must be \"block\" (fail-closed) or \"allow\" (fail-open)")
    categories = table.get("categories")
    return ModerationFilter(
        name,
        url,
        model=table.get("model"),
        api_key_env=table.get("api_key_env"),
        timeout_s=float(_positive(where, "timeout_s", table.get("timeout_s", 2.0), float)),
        on_error=on_error,
        categories=_strings(where, "categories", categories, non_empty=True) if categories is not None else None,
        stages=stages,
        output_chars=_positive(where, "output_chars", table.get("output_chars", 400)),
        overlap_chars=_positive(where, "overlap_chars", table.get("overlap_chars", 100)),
    )


def parse_filters(where: str, tables: Any) -> tuple[ContentFilter, ...]:
    """Filters from a list of ``content_filter`` tables; raises ``FilterConfigError`` naming the table."""
    if not isinstance(tables, list):
        raise FilterConfigError(f"{where}: content_filter must be an array of tables ([[content_filter]])")
    filters = tuple(_parse_one(f"{where} content_filter #{i + 1}", t) for i, t in enumerate(tables))
    names = [f.name for f in filters]
    if len(set(names)) != len(names):
        raise FilterConfigError(f"{where}: two content filters share a name; give each its own `name`")
    return filters


def load_filter_file(path: str | os.PathLike[str]) -> tuple[ContentFilter, ...]:
    """The server-wide default filters (``--content-filter FILE``): TOML, or JSON by its suffix,
    holding ``content_filter`` tables."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise FilterConfigError(f"{path}: cannot read content filter file: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise FilterConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"content_filter"}:
        raise FilterConfigError(f"{path}: only content_filter tables belong here")
    return parse_filters(str(path), data.get("content_filter", []))
