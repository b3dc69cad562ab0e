"""Offline throughput: N synthetic prompts (fixed input and output lengths, seeded) through the engine,
and optionally the same workload through HF transformers ``generate`` in batches, side by side.

Two workloads: ``random`` token ids (nothing to copy: speculation cannot help) and ``repeat``, a
chat asking the model to repeat a real English passage, whose greedy answer copies the prompt (the
case n-gram speculation is for).
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import torch

from tokenline.engine.config import EngineConfig

if TYPE_CHECKING:
    from tokenline.engine.messages import EngineStats
    from tokenline.frontend.tokenizer import Tokenizer
    from tokenline.llm import LLM
    from tokenline.sampling_params import SamplingParams

# The passage of the `repeat` workload: each prompt shuffles these sentences with its own seed.
PASSAGE_SENTENCES = [
    "The old lighthouse stood at the northern end of the island, where the cliffs fell straight into the sea.",
    "Every evening at dusk the keeper climbed the spiral stairs, trimmed the wick and polished the great lens.",
    "He wrote the weather in a leather logbook: the wind, the height of the waves and the ships that passed.",
    "In winter the storms came in from the west and the whole tower hummed like a bell.",
    "The village below had a bakery, a post office, a small school and a harbour full of fishing boats.",
    "On market days the square filled with carts of apples, cheese, wool and smoked fish.",
    "The children learned to read from a teacher who had once sailed around the world twice.",
    "She kept a globe on her desk and a jar of sand from every beach she had ever walked on.",
    "When the new electric lamp arrived by ship, the whole village gathered on the quay to watch.",
    "The keeper was proud of the lamp, but he kept the old oil lantern cleaned and ready all the same.",
    "Years later, when the power failed during a great storm, the lantern guided three boats safely home.",
    "The fishermen never forgot that night, and they still raise a glass to the keeper every spring.",
    "Today the lighthouse is a museum, and visitors can climb the stairs and read the old logbooks.",
    "The last page of the final logbook says only: calm sea, clear sky, all ships accounted for.",
]


@dataclass
class ThroughputResult:
    backend: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    speculative: str = "off"
    draft_tokens: int = 0  # speculative decoding: drafted tokens, and how many the model accepted
    accepted_tokens: int = 0
    constraint: str = "none"  # structured output on every request: "none" or "json"

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None


def synthetic_prompts(num_prompts: int, input_len: int, vocab_size: int, special_ids: set[int], seed: int) -> list[list[int]]:
    """Random token ids (no special tokens), the same for a given seed."""
    rng = random.Random(seed)
    ordinary = [i for i in range(vocab_size) if i not in special_ids]
    return [[rng.choice(ordinary) for _ in range(input_len)] for _ in range(num_prompts)]


def repeat_prompts(num_prompts: int, input_len: int, tokenizer: Tokenizer, seed: int) -> list[list[int]]:
    """Chat prompts asking to repeat a passage of about ``input_len`` tokens (the sentences of
    :data:`PASSAGE_SENTENCES`, shuffled per prompt), so the greedy answer copies the prompt."""
    prompts = []
    for i in range(num_prompts):
        rng = random.Random(seed * 1_000_003 + i)
        sentences: list[str] = []
        num_tokens = 0
        while num_tokens < input_len:
            batch = PASSAGE_SENTENCES[:]
            rng.shuffle(batch)
            for sentence in batch:
                if num_tokens >= input_len:
                    break
                sentences.append(sentence)
                num_tokens += len(tokenizer.encode(" " + sentence, add_special_tokens=False))
        passage = " ".join(sentences)
        chat = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{passage}"}]
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(chat), add_special_tokens=False))
    return prompts


def run_tokenline(model_dir: Path, prompts: list[list[int]], output_len: int, config: EngineConfig) -> ThroughputResult:
    from tokenline.llm import LLM
    from tokenline.sampling_params import SamplingParams

    llm = LLM(model_dir, **vars(config))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.engine.kv_cache.pool.reset_prefix_cache()  # the warm-up prompt must not flatter the run
    result, _, _ = _timed_generate(llm, prompts, params, config)
    del llm
    gc.collect()
    return result


def _timed_generate(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, config: EngineConfig, constraint: str = "none"
) -> tuple[ThroughputResult, EngineStats, EngineStats]:
    """One timed ``generate`` of every prompt, and the engine's stats before and after it."""
    before = llm.engine.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = llm.engine.stats()
    result = ThroughputResult(
        "tokenline",
        str(llm.engine.runner.dtype).removeprefix("torch."),
        len(prompts),
        sum(len(p) for p in prompts),
        sum(len(o.outputs[0].token_ids) for o in outputs),
        elapsed,
        speculative=config.speculative or "off",
        draft_tokens=after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
        accepted_tokens=after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
        constraint=constraint,
    )
    return result, before, after


@dataclass
class StructuredBench:
    """The same workload without and with a JSON schema on every request, on one engine."""

    unconstrained: ThroughputResult
    constrained: ThroughputResult
    compile_ms: list[float]  # uncached compilations of the schema, for p50 / p99
    engine_compiles: int  # compilations the engine ran during the constrained runs, and cache hits
    engine_cache_hits: int

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.compile_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> str:
        ratio = self.constrained.output_tokens_per_s / self.unconstrained.output_tokens_per_s
        return (
            f"json schema on every request: {self.constrained.output_tokens_per_s:.1f} output tok/s vs "
            f"{self.unconstrained.output_tokens_per_s:.1f} without ({ratio:.2f}x); "
            f"{self.constrained.output_tokens} vs {self.unconstrained.output_tokens} output tokens\n"
            f"grammar compile p50 {self.percentile_ms(0.5):.2f} ms, p99 {self.percentile_ms(0.99):.2f} ms "
            f"({len(self.compile_ms)} uncached compiles); in the run: {self.engine_compiles} compiled, "
            f"{self.engine_cache_hits} cache hits"
        )


def run_tokenline_structured(
    model_dir: Path,
    prompts: list[list[int]],
    output_len: int,
    config: EngineConfig,
    schema: dict,
    repeats: int = 2,
    num_compiles: int = 50,
) -> StructuredBench:
    """``prompts`` greedy without constraints and with ``schema`` on every request, on one engine,
    alternating ``repeats`` times and keeping each one's fastest run (a shared machine's noise only
    ever slows a run down); then ``num_compiles`` uncached compilations of the schema."""
    from tokenline.llm import LLM
    from tokenline.sampling_params import SamplingParams, StructuredOutputs

    llm = LLM(model_dir, **vars(config))
    compiler = llm.engine.grammar_compiler
    if compiler is None:
        raise ValueError(f"{model_dir} has no tokenizer.json: no structured output")
    spec = StructuredOutputs(json=schema)
    compiler.tokenizer()  # built once per engine, before any request: not part of the figures
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    best: dict[str, ThroughputResult] = {}
    compiles = hits = 0
    for _ in range(repeats):
        for structured in (None, spec):
            llm.engine.kv_cache.pool.reset_prefix_cache()
            params = SamplingParams(
                temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_outputs=structured
            )
            constraint = "none" if structured is None else "json"
            result, before, after = _timed_generate(llm, prompts, params, config, constraint)
            if structured is not None:
                compiles += after.grammar_compile_count - before.grammar_compile_count
                hits += after.grammar_cache_hits - before.grammar_cache_hits
            if constraint not in best or result.elapsed_s < best[constraint].elapsed_s:
                best[result.constraint] = result
    compile_ms = [compiler.compile(spec).seconds * 1e3 for _ in range(num_compiles)]
    bench = StructuredBench(best["none"], best["json"], compile_ms, compiles, hits)
    del llm
    gc.collect()
    return bench


def run_hf(model_dir: Path, prompts: list[list[int]], output_len: int, dtype: str, batch_size: int) -> ThroughputResult:
    """The same prompts through transformers ``generate``, ``batch_size`` at a time (no padding: all
    prompts have the same length), always producing ``output_len`` tokens."""
    from transformers import AutoModelForCausalLM

    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    output_tokens = 0
    with torch.inference_mode():
        warm = torch.tensor(prompts[:1])
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i : i + batch_size])
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=model.generation_config.pad_token_id or 0,
            )
            output_tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return ThroughputResult("hf-transformers", dtype, len(prompts), sum(len(p) for p in prompts), output_tokens, elapsed)


def format_table(results: list[ThroughputResult]) -> str:
    hf = {r.dtype: r for r in results if r.backend == "hf-transformers"}
    no_spec = {r.dtype: r for r in results if r.backend == "tokenline" and r.speculative == "off"}
    constrained = any(r.constraint != "none" for r in results)  # a column only when some row has one
    lines = [
        f"{'backend':<16} {'dtype':<9} {'spec':<6} " + (f"{'grammar':<8}" if constrained else "")
        + f"{'req/s':>7} {'prompt tok/s':>13} {'output tok/s':>13} "
        f"{'time s':>8} {'accept':>7} {'vs off':>7} {'vs HF':>7}",
    ]
    for r in results:
        ref = hf.get(r.dtype)
        ratio = f"{r.output_tokens_per_s / ref.output_tokens_per_s:.2f}x" if ref and r is not ref else ""
        off = no_spec.get(r.dtype) if r.speculative != "off" else None
        speedup = f"{r.output_tokens_per_s / off.output_tokens_per_s:.2f}x" if off else ""
        accept = f"{r.acceptance_rate:.0%}" if r.acceptance_rate is not None else ""
        lines.append(
            f"{r.backend:<16} {r.dtype:<9} {r.speculative:<6} " + (f"{r.constraint:<8}" if constrained else "")
            + f"{r.requests_per_s:>7.2f} {r.prompt_tokens_per_s:>13.1f} "
            f"{r.output_tokens_per_s:>13.1f} {r.elapsed_s:>8.1f} {accept:>7} {speedup:>7} {ratio:>7}"
        )
    return "\n".join(lines)
