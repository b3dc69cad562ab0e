"""A server with `--speculative mtp` on the tiny Qwen3.5 hybrid (random MTP weights) answers the
official client with the same greedy tokens as the engine without speculation, and its metrics
count the drafts; a model without an MTP head is refused at start-up with one line."""

from __future__ import annotations

import random
from pathlib import Path

import openai
import pytest

from tests.conftest import TinyQwen3_5
from tests.e2e.conftest import start_server
from tokenline import LLM, SamplingParams
from tokenline.cli import build_parser, serve_settings_from_args
from tokenline.model.random_models import make_qwen3_tiny

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_5: TinyQwen3_5) -> Path:
    # Louder DeltaNet outputs: tokens that depend on the recurrent state (see tests/engine).
    return tiny_qwen3_5(linear_scale=40.0, mtp_layers=1)


def test_same_greedy_tokens_as_without_speculation(tmp_path: Path, model_dir: Path) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(0, 248000) for _ in range(n)] for n in (9, 30)]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    assert all(len(set(tokens)) > MAX_TOKENS // 2 for tokens in expected)

    flags = ("--speculative", "mtp", "--num-speculative-tokens", "3", "--dtype", "float32",
             "--served-model-name", "tiny")
    with start_server(tmp_path, str(model_dir), *flags) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="none", max_retries=0, timeout=120)
        got = []
        for prompt in prompts:
            # vLLM's extension: return_token_ids gives the completion's token ids beside the text.
            answer = client.completions.create(
                model="tiny", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS
            got.append(answer.choices[0].token_ids)  # type: ignore[attr-defined]
        metrics = server.metrics()

    assert got == expected
    drafts = metrics["vllm:spec_decode_num_drafts_total"]
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens_total"]
    assert drafts > 0 and draft_tokens >= drafts
    assert 0 <= metrics["vllm:spec_decode_num_accepted_tokens_total"] <= draft_tokens
    assert metrics["vllm:generation_tokens_total"] == MAX_TOKENS * len(prompts)


def test_serve_refuses_a_model_without_an_mtp_head(tmp_path: Path) -> None:
    make_qwen3_tiny(tmp_path)
    args = build_parser().parse_args(["serve", str(tmp_path), "--speculative", "mtp"])
    with pytest.raises(ValueError, match="--speculative mtp needs a hybrid Qwen3.5-class model with an MTP head"):
        serve_settings_from_args(args)
