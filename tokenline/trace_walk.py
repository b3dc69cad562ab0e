"""``tokenline trace``: walk one chat request through the real engine and record each stage.

The walk drives the offline ``LLM``'s own parts — ``InputProcessor`` (render, tokenize, check,
fan out), ``EngineCore`` (scheduler, KV cache manager, runner, sampler) and ``RequestState``
(detokenizer, stop strings, usage) — one step at a time, and reads what each stage did: the
runner's scheduled chunk (start position, block table, state slot), the engine's ``StepRecord``,
the sampler's top-K logprobs and what the text stream holds back. Nothing is re-implemented: a
thin wrapper around the runner only copies down the batch it is given.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenline.engine.messages import StepRecord
from tokenline.frontend.processor import PromptError
from tokenline.frontend.request_state import RequestState
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.gateway.ledger import PriceTable
from tokenline.llm import LLM
from tokenline.model.batch import SampledToken, ScheduledBatch
from tokenline.sampling_params import SamplingParams


@dataclass
class PromptToken:
    id: int
    piece: str  # the vocabulary entry (byte-level pieces show a space as "Ġ")
    text: str  # what the token decodes to on its own
    special: bool


@dataclass
class RenderedPrompt:
    text: str  # the chat template's output, special tokens as text
    special_tokens: list[str]  # the special tokens it holds, in order of first use
    tokens: list[PromptToken]


@dataclass
class ScheduledChunk:
    """What the scheduler gave the runner for this request in one engine step."""

    engine_step: int
    start_pos: int
    num_tokens: int
    kind: str  # "prefill" or "decode"
    block_table: list[int]
    state_slot: int | None
    duration_s: float  # the whole engine step (StepRecord.duration)
    num_seqs: int  # sequences in that step's batch


@dataclass
class Candidate:
    token_id: int
    text: str
    logprob: float


@dataclass
class DecodeStep:
    """One generated token: the sampler's choice and what the text stream did with it."""

    index: int
    engine_step: int
    token_id: int
    text: str  # the token decoded on its own
    logprob: float | None
    candidates: list[Candidate]
    emitted: str  # text released to the caller by this token
    held_partial_character: bool  # the detokenizer waits for the rest of a UTF-8 character
    held_stop_prefix: str  # text held back because it may begin a stop string


@dataclass
class KVClaim:
    block_size: int
    prompt_blocks: list[int]  # the table once the prompt is in the cache
    cached_blocks: list[int]  # of those, prefix-cache hits (shared, not computed)
    num_cached_tokens: int
    final_blocks: list[int]  # the table at the last step
    state_slot: int | None  # hybrid models: the recurrent-state slot


@dataclass
class StageTimes:
    queue_s: float | None  # arrival → first scheduled
    prefill_s: float  # engine steps that computed prompt tokens
    decode_s: float  # the other engine steps
    time_to_first_token_s: float | None
    num_prefill_steps: int
    num_decode_steps: int


@dataclass
class Receipt:
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float


@dataclass
class TraceRun:
    request_id: str
    kv: KVClaim
    times: StageTimes
    chunks: list[ScheduledChunk]
    steps: list[DecodeStep]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    receipt: Receipt


@dataclass
class Trace:
    model: str
    sampling: dict[str, Any]
    prompt: RenderedPrompt
    runs: list[TraceRun] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _BatchCopier:
    """Wraps the real runner: hands each batch on unchanged and keeps a copy of one request's seq."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner
        self.request_id = ""
        self.seqs: list[tuple[int, int, list[int], int | None, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def execute(self, batch: ScheduledBatch) -> dict[str, SampledToken]:
        for seq in batch.seqs:
            if seq.request_id == self.request_id:
                self.seqs.append((seq.start_pos, seq.num_tokens, list(seq.block_table), seq.state_slot,
                                  len(batch.seqs)))
        return self._runner.execute(batch)


def walk(
    llm: LLM,
    question: str,
    *,
    system: str | None = None,
    max_tokens: int = 16,
    temperature: float | None = 0.0,
    top_candidates: int = 5,
    stop: Sequence[str] = (),
    repeat: int = 1,
    prices: PriceTable | None = None,
    model_name: str | None = None,
) -> Trace:
    """Render ``question`` as a chat, run it ``repeat`` times (a repeat hits the prefix cache) and
    record every stage. Raises ``PromptError`` for a prompt the processor refuses."""
    if repeat < 1:
        raise PromptError("repeat", f"repeat must be at least 1, got {repeat}")
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": question}
    ]
    processor, tokenizer = llm.processor, llm.tokenizer
    rendered = processor.render_chat_text(messages)
    prompt_ids = processor.encode_rendered(rendered)
    processor.check_prompt(prompt_ids, "messages")
    params = processor.resolve(
        SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=list(stop), logprobs=top_candidates),
        prompt_ids,
    )
    name = model_name or llm.model_dir.name
    trace = Trace(name, _sampling_facts(params), _rendered_prompt(tokenizer, str(rendered), prompt_ids))
    for attempt in range(repeat):
        trace.runs.append(_run_once(llm, f"trace-{attempt}", prompt_ids, params, prices or PriceTable(), name))
    return trace


def _sampling_facts(params: SamplingParams) -> dict[str, Any]:
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "max_tokens": params.max_tokens, "stop": list(params.stop), "logprobs": params.logprobs}


def _rendered_prompt(tokenizer: Tokenizer, text: str, ids: Sequence[int]) -> RenderedPrompt:
    special_ids = set(tokenizer.all_special_ids)
    tokens = [
        PromptToken(i, tokenizer.id_to_token(i) or "", tokenizer.decode([i], skip_special_tokens=False),
                    i in special_ids)
        for i in ids
    ]
    specials = list(dict.fromkeys(t.text for t in tokens if t.special))
    return RenderedPrompt(text, specials, tokens)


def _run_once(
    llm: LLM, group_id: str, prompt_ids: list[int], params: SamplingParams, prices: PriceTable, model: str
) -> TraceRun:
    engine, tokenizer = llm.engine, llm.tokenizer
    state: RequestState = llm.processor.fan_out(group_id, [prompt_ids], params)
    (engine_request,) = state.engine_requests
    request_id = engine_request.request_id
    seq_state = state.sequences[request_id]
    copier = _BatchCopier(engine.runner)
    copier.request_id = request_id
    engine.take_step_records()  # start from this request's steps only
    chunks: list[ScheduledChunk] = []
    steps: list[DecodeStep] = []
    engine.runner = copier  # type: ignore[assignment]
    try:
        engine.add_request(engine_request)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            records = engine.take_step_records()
            _raise_failures(llm)
            record = records[-1] if records else None
            for start_pos, num_tokens, table, slot, num_seqs in copier.seqs:
                chunks.append(_chunk(record, start_pos, num_tokens, table, slot, num_seqs, len(prompt_ids)))
            copier.seqs.clear()
            for output in outputs:
                if output.request_id != request_id:
                    continue
                before = len(steps)
                update = state.absorb(output)
                for k, token_id in enumerate(output.new_token_ids):
                    logprobs = (output.new_logprobs or [])[k] if output.new_logprobs else None
                    steps.append(DecodeStep(
                        index=before + k,
                        engine_step=record.step if record is not None else -1,
                        token_id=token_id,
                        text=tokenizer.decode([token_id], skip_special_tokens=False),
                        logprob=logprobs.logprob if logprobs is not None else None,
                        candidates=[Candidate(t, tokenizer.decode([t], skip_special_tokens=False), lp)
                                    for t, lp in (logprobs.top if logprobs is not None else [])],
                        emitted=update.text if k == len(output.new_token_ids) - 1 else "",
                        held_partial_character=seq_state.stream.holds_partial_character,
                        held_stop_prefix=seq_state.stream.held_stop_prefix,
                    ))
                if update.abort:
                    # A stop string ended the text: free the engine's work at once, as LLM does.
                    aborted = engine.abort_request(request_id)
                    if aborted is not None:
                        state.absorb_final(aborted)
    finally:
        engine.runner = copier._runner
        for running in state.running_in_engine():
            engine.abort_request(running)
    usage = state.usage()
    timings = seq_state.engine_final.timings if seq_state.engine_final is not None else None
    prefill = [c for c in chunks if c.kind == "prefill"]
    prompt_table = prefill[-1].block_table if prefill else []
    block_size = engine.kv_cache.block_size
    cached_blocks = prompt_table[: usage.cached_tokens // block_size]
    times = StageTimes(
        queue_s=(timings.first_scheduled - timings.arrival)
        if timings is not None and timings.first_scheduled is not None else None,
        prefill_s=sum(c.duration_s for c in prefill),
        decode_s=sum(c.duration_s for c in chunks if c.kind == "decode"),
        time_to_first_token_s=(timings.first_token - timings.arrival)
        if timings is not None and timings.first_token is not None else None,
        num_prefill_steps=len(prefill),
        num_decode_steps=len(chunks) - len(prefill),
    )
    kv = KVClaim(block_size, prompt_table, cached_blocks, usage.cached_tokens,
                 chunks[-1].block_table if chunks else [], chunks[-1].state_slot if chunks else None)
    cost = prices.cost(model, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
    receipt = Receipt(model, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, cost)
    return TraceRun(request_id, kv, times, chunks, steps, seq_state.stream.text, seq_state.finish_reason,
                    seq_state.stop_reason, receipt)


def _chunk(
    record: StepRecord | None, start_pos: int, num_tokens: int, table: list[int], slot: int | None, num_seqs: int,
    num_prompt: int,
) -> ScheduledChunk:
    return ScheduledChunk(
        engine_step=record.step if record is not None else -1,
        start_pos=start_pos,
        num_tokens=num_tokens,
        kind="prefill" if start_pos < num_prompt else "decode",
        block_table=table,
        state_slot=slot,
        duration_s=record.duration if record is not None else 0.0,
        num_seqs=num_seqs,
    )


def _raise_failures(llm: LLM) -> None:
    for failed in llm.engine.take_failed_requests():
        raise PromptError(failed.param, failed.message)


# ------------------------------------------------------------------------------------ rendering


def render(trace: Trace, console: Any) -> None:
    """Print the trace on a ``rich`` console, stage by stage."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    template = Text()
    pattern = "|".join(re.escape(s) for s in sorted(trace.prompt.special_tokens, key=len, reverse=True))
    last = 0
    for match in re.finditer(pattern, trace.prompt.text) if pattern else []:
        template.append(trace.prompt.text[last : match.start()])
        template.append(match.group(), style="bold magenta reverse")
        last = match.end()
    template.append(trace.prompt.text[last:])
    console.print(Panel(template, title=f"1. rendered chat template ({trace.model})", title_align="left"))

    ids = Text()
    for token in trace.prompt.tokens:
        ids.append(f"{token.id}", style="bold magenta" if token.special else "cyan")
        ids.append(f"·{token.piece!r} ", style="dim")
    console.print(Panel(ids, title=f"2. {len(trace.prompt.tokens)} prompt tokens (id·piece)", title_align="left"))

    for number, run in enumerate(trace.runs, 1):
        console.rule(f"run {number} of {len(trace.runs)} · request {run.request_id}")
        kv = run.kv
        hit = (f"{kv.num_cached_tokens} tokens from the prefix cache: blocks {kv.cached_blocks}"
               if kv.num_cached_tokens else "no prefix-cache hit")
        slot = f"\nrecurrent-state slot: {kv.state_slot}" if kv.state_slot is not None else ""
        console.print(Panel(
            f"prompt blocks ({kv.block_size} tokens each): {kv.prompt_blocks}\n{hit}\n"
            f"blocks at the last step: {kv.final_blocks}{slot}",
            title="3. KV cache", title_align="left"))
        t = run.times
        queue = f"{t.queue_s * 1e3:.2f} ms" if t.queue_s is not None else "-"
        ttft = f"{t.time_to_first_token_s * 1e3:.1f} ms" if t.time_to_first_token_s is not None else "-"
        console.print(Panel(
            f"queue {queue} · prefill {t.prefill_s * 1e3:.1f} ms in {t.num_prefill_steps} step(s) · "
            f"first token {ttft} · decode {t.decode_s * 1e3:.1f} ms in {t.num_decode_steps} step(s)",
            title="4. time (engine step records)", title_align="left"))
        table = Table(title="5. decode steps: top candidates, the chosen token, the text stream",
                      title_justify="left")
        for column in ("#", "step", "chosen", "logprob", "candidates", "emitted", "held back"):
            table.add_column(column)
        for step in run.steps:
            candidates = Text()
            for c in step.candidates:
                style = "bold green" if c.token_id == step.token_id else ""
                candidates.append(f"{c.text!r} {c.logprob:.2f}  ", style=style)
            held = []
            if step.held_partial_character:
                held.append("partial UTF-8 character")
            if step.held_stop_prefix:
                held.append(f"stop prefix {step.held_stop_prefix!r}")
            table.add_row(str(step.index), str(step.engine_step), repr(step.text),
                          f"{step.logprob:.3f}" if step.logprob is not None else "-",
                          candidates, repr(step.emitted), ", ".join(held))
        console.print(table)
        r = run.receipt
        console.print(Panel(
            f"text: {run.text!r}\nfinish: {run.finish_reason} (stop reason {run.stop_reason!r})\n"
            f"prompt {r.prompt_tokens} (cached {r.cached_tokens}) · completion {r.completion_tokens} · "
            f"cost ${r.cost_usd:.8f}",
            title="6. receipt", title_align="left"))


def load_prices(path: str | Path | None) -> PriceTable:
    return PriceTable.from_file(path) if path else PriceTable()
