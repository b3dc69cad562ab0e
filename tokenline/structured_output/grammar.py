"""Structured output on llguidance: the grammar of a ``StructuredOutputs`` spec, its validation,
an off-loop compiler with a cache, and the per-request matcher that fills token bitmasks.

No torch here: the API process imports :func:`validate` to refuse bad specs before any engine
work. The engine builds one :class:`GrammarCompiler` (one ``LLTokenizer`` over the model's
``tokenizer.json``, made once, lazily, in the compiler's thread) and gives each constrained request
a :class:`GrammarState`. A bitmask row has one bit per token id (bit ``i % 32`` of int32 word
``i // 32``); a set bit allows the token, as in llguidance and vLLM.

What one spec may cost is bounded by llguidance's parser limits (:data:`GRAMMAR_LIMITS`, tighter
than its defaults): a spec past them is refused with a 400 naming its field. Most of a grammar's
memory is its lexer, built lazily and shared by every copy of the matcher: a regex like
``((a{100}){100}){100}`` took 186 MiB and 1.1 s at its first mask under llguidance's default fuel,
about 42 MiB and 0.3 s under these limits. So compiling includes the first masks (and forced
tokens), in the compiler's thread rather than the step loop, and the cache counts each
grammar by the memory that took (:meth:`GrammarCompiler.compile`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer

from tokenline.model.host_memory import allocated_bytes
from tokenline.sampling_params import SamplingParamsError, StructuredOutputs

# JSON is emitted compactly (no free whitespace): a weak model cannot wander off into endless
# blanks, and ``{"a":1}`` is as valid as ``{ "a": 1 }``.
_JSON_OPTIONS = {"whitespace_flexible": False}
_JSON_OBJECT_SCHEMA = {"type": "object"}

# llguidance's parser limits for every spec, its defaults in the comments. The lexer's fuel bounds
# both the time and the memory of building its regexes (~200 bytes a unit: 200k is ~42 MiB at
# most, where the default 1M let one regex take 186 MiB); its states (1-2 kB each) bound what a
# grammar grows by while requests generate; verbose errors would quote the parser's state.
GRAMMAR_LIMITS = {
    "initial_lexer_fuel": 200_000,  # 1_000_000
    "step_lexer_fuel": 100_000,  # 200_000, per mask
    "max_lexer_states": 20_000,  # 250_000
    "verbose_errors": False,  # True
}
# The bounds of a compiled grammar's size estimate: a spec's text costs at least a few bytes a
# character; the most the limits above let compiling take (measured: 42 MiB) with room to spare,
# so a measurement swollen by other threads' allocations (see compile) counts as no more.
MIN_GRAMMAR_BYTES = 64 << 10
MAX_GRAMMAR_BYTES = 64 << 20
# What a grammar costs the process beyond the bytes malloc handed it (its lexer is many small
# allocations; freed ones leave holes): 600 distinct ~11 MiB grammars through a 256 MiB cache grew
# the engine's RSS by 285-292 MiB, 1.12-1.14x what was counted. Counted in, the bound holds for RSS.
ALLOCATOR_OVERHEAD = 1.15
# Compiling walks a copy of the matcher through its masks and forced tokens (``{"name":"`` of a
# schema, the literal run of a regex) as far as this, as a request's first steps would.
WARM_UP_ROUNDS = 4
WARM_UP_FORCED_TOKENS = 16


def parser_limits() -> LLParserLimits:
    return LLParserLimits(**GRAMMAR_LIMITS)


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
    error = LLMatcher.validate_grammar(text, limits=parser_limits())
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

    def __init__(self, matcher: LLMatcher, vocab_size: int, seconds: float, nbytes: int = MIN_GRAMMAR_BYTES) -> None:
        self._template = matcher
        self.vocab_size = vocab_size
        self.seconds = seconds  # how long compiling took
        self.nbytes = nbytes  # the memory it holds, estimated (GrammarCompiler.compile)

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


@dataclass
class _CacheEntry:
    future: Future[CompiledGrammar]
    nbytes: int = 0  # counted once compiled


class GrammarCompiler:
    """Compiles specs off the step loop, with a cache bounded in bytes.

    ``submit`` returns at once with a future; requests of one tenant with the same spec share it.
    Keys are ``(tenant, StructuredOutputs.key())``: a tenant never finds another tenant's grammar
    compiled, so the time to its first token says nothing about what others asked for. Compiled
    grammars are kept, least recently used evicted first, while their estimated sizes add up to at
    most ``cache_bytes`` (with the one being compiled: room is made for it before, guessing it
    takes what the last one did); one larger than that serves its requests and is not kept. An evicted
    grammar lives on while requests still use it. A failed compilation's future raises
    ``SamplingParamsError``; failures are not cached, so a retry recompiles.
    """

    def __init__(
        self, tokenizer_path: Path, vocab_size: int, eos_token_ids: Iterable[int], cache_bytes: int = 256 << 20,
    ) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.cache_bytes = cache_bytes
        # One thread: compilations are measured one at a time anyway, and one thread's malloc arena
        # reuses what evicted grammars freed (two threads' arenas each grew towards the bound).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        # One measured compilation at a time (``compile`` may also be called directly): two at once
        # would each count the other's memory.
        self._measuring = threading.Lock()
        self._tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], _CacheEntry] = OrderedDict()
        # Counters (read by EngineStats and the benchmark).
        self.compile_seconds: list[float] = []
        self.num_cache_hits = 0
        self.num_cached_bytes = 0
        self.num_evictions = 0
        self._last_nbytes = 0  # the size of the last grammar compiled

    @property
    def words(self) -> int:
        return bitmask_words(self.vocab_size)

    @property
    def num_cached(self) -> int:
        """Grammars in the cache, compiling ones included."""
        return len(self._cache)

    def tokenizer(self) -> LLTokenizer:
        # About a second for a 250k vocabulary: made once, in the first compiling thread.
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(
                    str(self.tokenizer_path), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            return self._tokenizer

    def submit(self, spec: StructuredOutputs, tenant: str | None = None) -> Future[CompiledGrammar]:
        key = (tenant or "", spec.key())
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and not (entry.future.done() and _failed(entry.future)):
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return entry.future
            entry = _CacheEntry(self._pool.submit(self._compile_to_keep, spec))
            self._cache[key] = entry
        # The callback names the key, not the entry: a future holding its entry would make a cycle
        # that keeps every evicted grammar alive until the garbage collector's next full pass.
        entry.future.add_done_callback(lambda future: self._settle(key, future))
        return entry.future

    def _settle(self, key: tuple[str, str], future: Future[CompiledGrammar]) -> None:
        """A compilation ended: count a kept grammar's bytes and evict down to the bound."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is None or entry.future is not future:
                return  # evicted while compiling, or replaced by a retry
            if _failed(entry.future):
                del self._cache[key]
                return
            entry.nbytes = self._last_nbytes = entry.future.result().nbytes
            if entry.nbytes > self.cache_bytes:
                del self._cache[key]  # would flush everything else and still not fit
                return
            self.num_cached_bytes += entry.nbytes
            self._evict_to(self.cache_bytes)

    def _compile_to_keep(self, spec: StructuredOutputs) -> CompiledGrammar:
        # Room first for what this grammar will take (guessed: as much as the last one), so that
        # the cache and the grammar being compiled hold no more than the bound together.
        with self._lock:
            self._evict_to(self.cache_bytes - self._last_nbytes)
        return self.compile(spec)

    def _evict_to(self, limit: int) -> None:
        """Evict compiled grammars, least recently used first, until they hold at most ``limit``
        bytes (compiling ones hold none yet and stay). Call with the lock held."""
        for key in [k for k, e in self._cache.items() if e.nbytes]:
            if self.num_cached_bytes <= limit:
                return
            self.num_cached_bytes -= self._cache.pop(key).nbytes
            self.num_evictions += 1

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Compile now, in this thread, bypassing the cache (``submit`` runs this in the pool).

        The matcher is built and a copy of it run through its first masks and forced tokens, as a
        request's first steps would (``WARM_UP_ROUNDS``): that builds most of the lexer the grammar
        keeps (shared by every copy), here rather than in the step loop, and a spec past
        :data:`GRAMMAR_LIMITS` fails now, as its caller's 400. The grammar's size is what malloc
        handed out meanwhile times ``ALLOCATOR_OVERHEAD``. Every thread's allocations count, the
        step loop's at the same moment too, so the estimate is clamped to ``[MIN_GRAMMAR_BYTES +
        2 x the grammar's text, MAX_GRAMMAR_BYTES]``; without glibc it is the maximum. What the
        lexer adds later, while requests generate, is not counted (measured: under 1 MiB for a
        grammar whose compiling took 11); ``max_lexer_states`` bounds it.
        """
        tokenizer = self.tokenizer()  # once per engine; not counted as compile time
        text = grammar_text(spec)
        with self._measuring:
            before = allocated_bytes()
            start = time.perf_counter()
            try:
                matcher = LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
            except (ValueError, TypeError, RuntimeError) as exc:
                raise SamplingParamsError(_param(spec), f"invalid {spec.kind}: {exc}") from exc
            if matcher.is_error():
                raise SamplingParamsError(_param(spec), f"invalid {spec.kind}: {matcher.get_error().strip()}")
            self._warm_up(spec, matcher)
            seconds = time.perf_counter() - start
            after = allocated_bytes()
        floor = MIN_GRAMMAR_BYTES + 2 * len(text)
        measured = MAX_GRAMMAR_BYTES if before is None or after is None else int((after - before) * ALLOCATOR_OVERHEAD)
        self.compile_seconds.append(seconds)
        return CompiledGrammar(matcher, self.vocab_size, seconds, min(max(measured, floor), MAX_GRAMMAR_BYTES))

    def _warm_up(self, spec: StructuredOutputs, matcher: LLMatcher) -> None:
        probe = matcher.deep_copy()
        mask = np.zeros(self.words, dtype=np.int32)
        for _ in range(WARM_UP_ROUNDS):
            probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            forced = probe.compute_ff_tokens() if not probe.is_error() else []
            if not forced:
                break
            probe.consume_tokens(forced[:WARM_UP_FORCED_TOKENS])
        if probe.is_error():
            error = probe.get_error().strip().splitlines()[0]  # past it: "<non-verbose/>"
            message = f"{spec.kind} is too complex for this server's grammar limits: {error}"
            raise SamplingParamsError(_param(spec), message)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _failed(future: Future[CompiledGrammar]) -> bool:
    return future.cancelled() or future.exception() is not None
