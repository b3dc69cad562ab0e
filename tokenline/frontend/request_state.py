"""The request processor's output side: engine outputs in, text deltas, finish reasons and usage out.

One ``RequestState`` per caller request (all its prompts and ``n`` choices), shared by the server
and the offline ``LLM``. Tokens are taken one at a time, so a stop string that ends the text also
ends the token ids (a speculative step can bring several at once); the caller aborts a sequence
whose text ended while the engine still runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenline.engine.messages import EngineOutput, EngineRequest, FinishReason, TokenLogprobs
from tokenline.frontend.chat_output import ChatOutputParser
from tokenline.frontend.text_stream import TextStream
from tokenline.sampling_params import SamplingParams


@dataclass
class SequenceState:
    """One generated sequence (one choice of the response)."""

    index: int
    request_id: str  # the engine request id
    prompt_index: int
    stream: TextStream
    chat_output: ChatOutputParser | None = None  # reasoning / tool-call split of a chat choice
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when asked: one entry per prompt token
    finish_reason: str | None = None  # set once the text has ended
    num_cached_tokens: int = 0
    # The engine's final word (it may come after the text ended, e.g. after a stop string).
    engine_final: EngineOutput | None = None
    first_token_at: float | None = None
    last_output_at: float | None = None
    content_filter: str | None = None  # the output filter that ended the text, if one did
    # Per token: the characters its ids decode to so far, counted once its text is whole (None
    # while it ends inside a character). Says which tokens a piece of text shows.
    token_ends: list[int | None] = field(default_factory=list)
    num_withheld: int = 0  # tokens an output filter's cut took out of token_ids (still billed)
    # Under an output filter, what the caller has been given: characters of text, tokens.
    shown_chars: int = 0
    shown_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_produced(self) -> int:
        """Tokens the engine actually generated (what is billed), known exactly once it is final."""
        if self.engine_final is not None:
            return self.engine_final.num_output_tokens
        return len(self.token_ids) + self.num_withheld

    def tokens_within(self, chars: int) -> int:
        """How many leading tokens decode wholly within the first ``chars`` characters."""
        for i in range(len(self.token_ends) - 1, -1, -1):
            end = self.token_ends[i]
            if end is not None and end <= chars:
                return i + 1
        return 0

    def cut(self, at: int, by: str) -> None:
        """An output filter flagged the text from character ``at`` on: the text ends before it,
        and so do the token ids and logprobs: a token that reaches past ``at`` would spell what
        was cut. The caller aborts the engine request; the tokens it produced are still billed."""
        self.stream.text = self.stream.text[:at]
        keep = self.tokens_within(at)
        self.num_withheld += len(self.token_ids) - keep
        del self.token_ids[keep:], self.logprobs[keep:], self.token_ends[keep:]
        self.finish_reason = "content_filter"
        self.content_filter = by

    def release(self, hold_chars: int) -> tuple[str, list[int], list[TokenLogprobs]]:
        """Under an output filter, what may be shown now that was not yet: the text but its last
        ``hold_chars`` characters (so a flagged phrase is never shown in part), and the ids and
        logprobs of the tokens wholly within the text shown; everything once the text ended."""
        text = self.stream.text
        upto = len(text) if self.finished else max(self.shown_chars, len(text) - hold_chars)
        delta = text[self.shown_chars : upto]
        self.shown_chars = max(self.shown_chars, upto)
        tokens = len(self.token_ids) if self.finished else self.tokens_within(self.shown_chars)
        ids, logprobs = self.token_ids[self.shown_tokens : tokens], self.logprobs[self.shown_tokens : tokens]
        self.shown_tokens = max(self.shown_tokens, tokens)
        return delta, ids, logprobs

    @property
    def stop_reason(self) -> int | str | None:
        """The stop string or stop token id that ended the text, if one did."""
        if self.stream.stopped:
            return self.stream.stop_string
        return self.engine_final.stop_reason if self.engine_final is not None else None


@dataclass
class SequenceUpdate:
    """What one engine output changed in a sequence."""

    seq: SequenceState
    text: str  # new text that may be shown now
    logprobs: list[TokenLogprobs]  # of the tokens shown now (empty unless logprobs were asked)
    num_new_tokens: int
    abort: bool = False  # a stop string ended the text while the engine still runs: abort it
    token_ids: list[int] = field(default_factory=list)  # the tokens shown now: the new ones kept


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class RequestState:
    group_id: str  # the response id; engine request ids are "{group_id}-{index}"
    prompts: list[list[int]]
    params: SamplingParams
    sequences: dict[str, SequenceState]
    engine_requests: list[EngineRequest]

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.engine_requests]

    @property
    def finished(self) -> bool:
        """Every choice's text has ended (the engine may still be catching up)."""
        return all(s.finished for s in self.sequences.values())

    def in_order(self) -> list[SequenceState]:
        return sorted(self.sequences.values(), key=lambda s: s.index)

    def running_in_engine(self) -> list[str]:
        """Engine requests whose final output has not arrived (what an abort must reach)."""
        return [s.request_id for s in self.sequences.values() if s.engine_final is None]

    def absorb(self, output: EngineOutput, now: float = 0.0) -> SequenceUpdate:
        """Fold one engine output into its sequence; ``now`` stamps its first and last token."""
        seq = self.sequences[output.request_id]
        if output.finished:
            seq.engine_final = output
        if output.prompt_logprobs is not None:
            seq.prompt_logprobs = output.prompt_logprobs
        if seq.finished:
            return SequenceUpdate(seq, "", [], 0)  # the text already ended; the engine is catching up
        seq.num_cached_tokens = output.num_cached_tokens
        text, kept = "", 0
        for token_id in output.new_token_ids:
            if seq.stream.stopped:
                break
            seq.token_ids.append(token_id)
            text += seq.stream.push([token_id])
            seq.token_ends.append(None if seq.stream.holds_partial_character else seq.stream.decoded_chars)
            kept += 1
        logprobs = (output.new_logprobs or [])[:kept]
        seq.logprobs.extend(logprobs)
        if kept:
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.last_output_at = now
        abort = False
        if seq.stream.stopped:
            seq.finish_reason = FinishReason.STOP.value
            abort = not output.finished  # free the engine's work at once
        elif output.finished:
            text += seq.stream.finish()
            seq.token_ends = [seq.stream.decoded_chars if end is None else end for end in seq.token_ends]
            seq.finish_reason = output.finish_reason.value  # type: ignore[union-attr]
        return SequenceUpdate(seq, text, logprobs, kept, abort, seq.token_ids[len(seq.token_ids) - kept :])

    def absorb_final(self, output: EngineOutput) -> None:
        """Late outputs after the caller's view ended: only the counts and timings matter now."""
        if output.finished:
            self.sequences[output.request_id].engine_final = output

    def usage(self) -> Usage:
        """Prompt tokens count once per prompt (not per choice); completion tokens are those the
        engine produced (after a stop string that can be a token more than the text shows)."""
        completion = sum(s.num_produced for s in self.sequences.values())
        cached: dict[int, int] = {}
        for seq in self.sequences.values():
            cached[seq.prompt_index] = max(cached.get(seq.prompt_index, 0), seq.num_cached_tokens)
        return Usage(sum(len(p) for p in self.prompts), sum(cached.values()), completion)
