"""Structured output on llguidance: the grammar of a ``StructuredOutputs`` spec, its validation,
an off-loop compiler with a cache, and the per-request matcher that fills token bitmasks.

No torch here: the API process imports :func:`validate` to refuse bad specs before any engine
work. The engine builds one :class:`GrammarCompiler` (one ``LLTokenizer`` over the model's
``tokenizer.json``, made once, lazily, in the compiler's thread) and gives each constrained request
a :class:`GrammarState`. A bitmask row has one bit per token id (bit ``i % 32`` of int32 word
``i // 32``); a set bit allows the token, as in llguidance and vLLM.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from tokenline.sampling_params import SamplingParamsError, StructuredOutputs

# JSON is emitted compactly (no free whitespace): a weak model cannot wander off into endless
# blanks, and ``{"a":1}`` is as valid as ``{ "a": 1 }``.
_JSON_OPTIONS = {"whitespace_flexible": False}
_JSON_OBJECT_SCHEMA = {"type": "object"}


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON form) that ``spec`` describes. Raises
    ``SamplingParamsError`` only for a ``json`` that is not JSON; validity is :func:`validate`'s."""
    kind = spec.kind
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise SamplingParamsError("structured_outputs.json", f"json is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise SamplingParamsError("structured_outputs.json", "json must be a JSON schema object")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise SamplingParamsError("structured_outputs.json", f"invalid json schema: {exc}") from exc
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(_JSON_OBJECT_SCHEMA, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex or "")
    if kind == "choice":
        # Each choice is matched literally: every character that is not a letter or digit is written
        # as a \x{...} escape, which llguidance's (Rust) regex syntax reads as that very character.
        return LLMatcher.grammar_from_regex("|".join(f"(?:{_literal(c)})" for c in spec.choice or ()))
    return LLMatcher.grammar_from_lark(spec.grammar or "")


def _literal(text: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _param(spec: StructuredOutputs) -> str:
    kind = spec.kind
    return "structured_outputs.json" if kind == "json_object" else f"structured_outputs.{kind}"


def validate(spec: StructuredOutputs) -> None:
    """Raise ``SamplingParamsError(param, message)`` if ``spec`` does not compile: an invalid or
    unsupported schema, a bad regex or Lark grammar. Bounded by llguidance's default parser limits
    (lexer fuel, grammar size), so a huge spec fails fast rather than hanging."""
    text = grammar_text(spec)
    error = LLMatcher.validate_grammar(text)
    if error:
        raise SamplingParamsError(_param(spec), f"invalid {spec.kind}: {error.strip()}")


def json_schema_error(schema: dict) -> str | None:
    """What llguidance finds wrong with a JSON schema (a missing ``$ref`` target, an unknown type,
    a bad ``pattern``), or None: the schema's own ``x-guidance`` options apply over ours. Checked
    alone, so the message names the schema's fault and carries no grammar around it."""
    try:
        text = LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return LLMatcher.validate_grammar(text).strip() or None


class CompiledGrammar:
    """A compiled grammar: a pristine matcher that each request copies."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, seconds: float) -> None:
        self._template = matcher
        self.vocab_size = vocab_size
        self.seconds = seconds  # how long compiling took

    def new_state(self, start_after_token_id: int | None = None) -> GrammarState:
        return GrammarState(self._template.deep_copy(), self.vocab_size, start_after_token_id)


class GrammarState:
    """One request's matcher. Before ``start_after_token_id`` appears it is inactive: no mask,
    and the tokens it sees only watch for that id."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, start_after_token_id: int | None = None) -> None:
        self.matcher = matcher
        self.words = bitmask_words(vocab_size)  # int32 words per bitmask row
        self.start_after_token_id = start_after_token_id
        self.active = start_after_token_id is None

    def accept(self, token_ids: Iterable[int]) -> bool:
        """Advance on generated tokens; False if the grammar rejects one (the matcher is then in error)."""
        for token_id in token_ids:
            if not self.active:
                self.active = token_id == self.start_after_token_id
                continue
            if not self.matcher.consume_token(token_id):
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (e.g. draft tokens) the grammar accepts from here, in order."""
        return self.matcher.validate_tokens(list(token_ids)) if token_ids else 0

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows as the only continuation from here (``{"name":"`` after
        ``{`` in a schema with one required key): appended without sampling them one by one."""
        return self.matcher.compute_ff_tokens() if self.active else []

    @property
    def terminated(self) -> bool:
        """The grammar is complete and admits nothing more (EOS aside): the output is finished."""
        return self.active and self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed tokens of the next position into ``bitmask[row]``."""
        target = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)

    def fill_with_drafts(self, bitmask: np.ndarray, row: int, drafts: Sequence[int]) -> None:
        """Rows ``row .. row + len(drafts)``: the next position, then the one after each draft,
        advancing through the drafts and rolling back, so the matcher ends where it began. The drafts
        must be valid (:meth:`num_valid`)."""
        for i, token_id in enumerate(drafts):
            self.fill(bitmask, row + i)
            if not self.matcher.consume_token(token_id):
                raise AssertionError(f"draft token {token_id} is not valid here: {self.error}")
        self.fill(bitmask, row + len(drafts))
        self.rollback(len(drafts))


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_executor: LLExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmasks(bitmask: np.ndarray, rows: Sequence[tuple[GrammarState, int, Sequence[int]]]) -> None:
    """Fill one step's bitmask [rows, words] int32: ``(state, first row, drafts)`` per constrained
    sequence. Sequences without drafts are filled in parallel by llguidance's executor, which
    releases the GIL; a sequence with drafts fills its 1 + k rows in turn."""
    global _executor
    plain = [(state.matcher, row) for state, row, drafts in rows if not drafts]
    if plain:
        with _executor_lock:
            if _executor is None:
                # One thread: the model's own threads hold the cores during a step, and a pool of
                # spinning mask threads beside them cost a server 13-15% of its throughput (c=8).
                _executor = LLExecutor(num_threads=1)
        _executor.unsafe_compute_mask_ptr(plain, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])
    for state, row, drafts in rows:
        if drafts:
            state.fill_with_drafts(bitmask, row, drafts)


class GrammarCompiler:
    """Compiles specs off the step loop, a cache keyed by ``StructuredOutputs.key()``.

    ``submit`` returns at once with a future; requests with the same spec share it. A failed
    compilation's future raises ``SamplingParamsError``; failures are not cached, so a retry recompiles.
    """

    def __init__(
        self, tokenizer_path: Path, vocab_size: int, eos_token_ids: Iterable[int], max_workers: int = 2
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._tokenizer: LLTokenizer | None = None
        self._cache: dict[str, Future[CompiledGrammar]] = {}
        # Counters (read by EngineStats and the benchmark).
        self.compile_seconds: list[float] = []
        self.num_cache_hits = 0

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    def tokenizer(self) -> LLTokenizer:
        # About a second for a 250k vocabulary: made once, in the first compiling thread.
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(
                    str(self.tokenizer_path), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            return self._tokenizer

    def submit(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        key = spec.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self.num_cache_hits += 1
                return future
            future = self._pool.submit(self.compile, spec)
            self._cache[key] = future
            return future

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile now, in this thread, bypassing the cache (``submit`` runs this in the pool)."""
        tokenizer = self.tokenizer()  # once per engine; not counted as compile time
        start = time.perf_counter()
        text = grammar_text(spec)
        try:
            matcher = LLMatcher(tokenizer, text, log_level=0)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise SamplingParamsError(_param(spec), f"invalid {spec.kind}: {exc}") from exc
        if matcher.is_error():
            raise SamplingParamsError(_param(spec), f"invalid {spec.kind}: {matcher.get_error().strip()}")
        seconds = time.perf_counter() - start
        self.compile_seconds.append(seconds)
        return CompiledGrammar(matcher, self.vocab_size, seconds)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
