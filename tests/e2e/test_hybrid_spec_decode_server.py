"""`tokenline serve --speculative ngram` on a hybrid model (the tiny Qwen3.5, its DeltaNet outputs
scaled up so that its tokens depend on the recurrent state): through the official client, the same
float32 greedy completions as the offline engine without speculation, and /metrics counts drafts
both accepted and rejected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import TinyQwen3_5
from tests.e2e.conftest import Server, start_server
from tests.engine.test_hybrid_spec_decode import LINEAR_SCALE, repetitive_prompts
from tokenline import LLM, SamplingParams

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_5: TinyQwen3_5) -> Path:
    return tiny_qwen3_5(linear_scale=LINEAR_SCALE)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ("--speculative", "ngram", "--prompt-lookup-min", "1", "--dtype", "float32", "--served-model-name", "tiny")
    with start_server(tmp_path_factory.mktemp("spec"), str(model_dir), *flags) as server:
        yield server


def test_greedy_completions_match_the_engine_without_speculation(model_dir: Path, server: Server) -> None:
    prompts = repetitive_prompts(4, seed=1)
    client = openai.OpenAI(base_url=server.api_url, api_key="unused", timeout=120)
    got = [
        client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
        for prompt in prompts
    ]

    plain = LLM(model_dir, dtype="float32", num_kv_blocks=64, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert got == [o.outputs[0].text for o in plain.generate(prompts, params)]

    metrics = server.metrics()
    assert metrics["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens_total"] < metrics["vllm:spec_decode_num_draft_tokens_total"]
