"""Offline throughput: N synthetic prompts (fixed input and output lengths, seeded) through the engine,
and optionally the same workload through HF transformers ``generate`` in batches, side by side."""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenline.engine.config import EngineConfig


@dataclass
class ThroughputResult:
    backend: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def synthetic_prompts(num_prompts: int, input_len: int, vocab_size: int, special_ids: set[int], seed: int) -> list[list[int]]:
    """Random token ids (no special tokens), the same for a given seed."""
    rng = random.Random(seed)
    ordinary = [i for i in range(vocab_size) if i not in special_ids]
    return [[rng.choice(ordinary) for _ in range(input_len)] for _ in range(num_prompts)]


def run_tokenline(model_dir: Path, prompts: list[list[int]], output_len: int, config: EngineConfig) -> ThroughputResult:
    from tokenline.llm import LLM
    from tokenline.sampling_params import SamplingParams

    llm = LLM(model_dir, **vars(config))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.engine.kv_cache.pool.reset_prefix_cache()  # the warm-up prompt must not flatter the run
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    result = ThroughputResult(
        "tokenline",
        str(llm.engine.runner.dtype).removeprefix("torch."),
        len(prompts),
        sum(len(p) for p in prompts),
        sum(len(o.outputs[0].token_ids) for o in outputs),
        elapsed,
    )
    del llm
    gc.collect()
    return result


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
    lines = [
        f"{'backend':<16} {'dtype':<9} {'req/s':>7} {'prompt tok/s':>13} {'output tok/s':>13} {'time s':>8} {'vs HF':>7}",
    ]
    for r in results:
        ref = hf.get(r.dtype)
        ratio = f"{r.output_tokens_per_s / ref.output_tokens_per_s:.2f}x" if ref and r is not ref else ""
        lines.append(
            f"{r.backend:<16} {r.dtype:<9} {r.requests_per_s:>7.2f} {r.prompt_tokens_per_s:>13.1f} "
            f"{r.output_tokens_per_s:>13.1f} {r.elapsed_s:>8.1f} {ratio:>7}"
        )
    return "\n".join(lines)
