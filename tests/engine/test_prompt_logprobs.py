"""Prompt logprobs (vLLM's ``prompt_logprobs``) on the real default model: every prompt position
scored from the prefill's logits, equal to HF transformers', however the prompt is chunked, whether
its prefix is cached, and with ``max_tokens=0`` (the prompt alone, nothing generated)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenline import LLM, SamplingParams
from tokenline.engine.messages import EngineRequest
from tokenline.engine.request import Request
from tokenline.frontend.tokenizer import Tokenizer
from tokenline.model.batch import TokenLogprobs
from tokenline.model.prompt_logprobs import score_tokens

TOLERANCE = 1e-3  # nats; float32 on both sides differs by ~1e-4
TEXT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who had never once left the valley. Every morning he wound the clocks of the square, and every "
    "evening he walked to the river to watch the light fade over the water."
)


@pytest.fixture(scope="module")
def prompt(default_model_dir: Path) -> list[int]:
    return Tokenizer.from_dir(default_model_dir).encode(TEXT, add_special_tokens=False)


@pytest.fixture(scope="module")
def reference(default_model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] log-softmax of transformers' logits at each prompt position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


@pytest.fixture(scope="module")
def chunked(default_model_dir: Path) -> LLM:
    # 16-token steps: the prompt's positions come from several prefill chunks, with prefix caching
    # on. (The server's test scores a prompt prefilled in one long chunk: tests/e2e/test_vllm_fields.py.)
    llm = LLM(default_model_dir, dtype="float32", kv_cache_memory_gib=0.25, max_num_batched_tokens=16)
    llm.engine.check_integrity_every_step = True
    return llm


def assert_matches(entries: list[TokenLogprobs | None], prompt: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert entry is not None
        row = reference[position - 1]
        token = prompt[position]
        assert abs(entry.logprob - row[token].item()) < TOLERANCE, position
        assert entry.rank == int((row >= row[token]).sum()), position
        top_values, top_ids = row.topk(k)
        assert [t for t, _ in entry.top] == top_ids.tolist() or k == 0 or _near_tie(row, top_values), position
        for (_, value), expected in zip(entry.top, top_values.tolist()):
            assert abs(value - expected) < TOLERANCE


def _near_tie(row: torch.Tensor, top_values: torch.Tensor) -> bool:
    return bool((top_values[:-1] - top_values[1:]).abs().min() < TOLERANCE)


def test_prompt_only_request_scores_every_position_across_chunks(
    chunked: LLM, prompt: list[int], reference: torch.Tensor
) -> None:
    assert len(prompt) > 3 * 16  # several chunks
    (out,) = chunked.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert_matches(out.prompt_logprobs, prompt, reference, 3)
    pool = chunked.engine.kv_cache.pool
    chunked.engine.scheduler.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks  # the prompt-only request freed its blocks


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(
    chunked: LLM, prompt: list[int], reference: torch.Tensor
) -> None:
    # The first request leaves the prompt's blocks in the prefix cache...
    first = chunked.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    again = chunked.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None
    # ...which a request for prompt logprobs does not skip: it needs every position's logits.
    scored = chunked.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0
    assert_matches(scored.prompt_logprobs, prompt, reference, 0)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids


def test_prompt_logprobs_beside_other_requests_and_n(chunked: LLM, prompt: list[int], reference: torch.Tensor) -> None:
    llm = chunked
    others = [llm.tokenizer.encode("The capital of France is"), llm.tokenizer.encode("1, 2, 3,")]
    outs = llm.generate(
        [others[0], prompt, others[1]],
        [SamplingParams(max_tokens=4), SamplingParams(n=2, max_tokens=3, prompt_logprobs=1, temperature=1.0, seed=3),
         SamplingParams(max_tokens=4, prompt_logprobs=2)],
    )
    assert outs[0].prompt_logprobs is None
    assert_matches(outs[1].prompt_logprobs, prompt, reference, 1)
    assert len(outs[1].outputs) == 2 and all(len(o.token_ids) == 3 for o in outs[1].outputs)
    short = outs[2].prompt_logprobs
    assert len(short) == len(others[1]) and short[0] is None and all(len(e.top) == 2 for e in short[1:])


def test_a_one_token_prompt_has_a_single_empty_entry(chunked: LLM) -> None:
    (out,) = chunked.generate([[504]], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert out.prompt_logprobs == [None] and len(out.outputs[0].token_ids) == 1


def test_scores_do_not_depend_on_the_slice_size() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(23, 8)
    targets = torch.randint(0, 40, (23,))
    whole = score_tokens(head, hidden, targets, num_top=4, vocab_size=40, slice_elements=10**9)
    sliced = score_tokens(head, hidden, targets, num_top=4, vocab_size=40, slice_elements=3 * 40 + 1)
    assert len(whole) == len(sliced) == 23
    for a, b in zip(whole, sliced):  # a matmul of another shape may round the last bit differently
        assert (a.rank, [t for t, _ in a.top]) == (b.rank, [t for t, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
    logprobs = head(hidden)[:, :40].log_softmax(-1)  # padding columns are no token
    for i, entry in enumerate(whole):
        assert entry.logprob == pytest.approx(logprobs[i, targets[i]].item(), abs=1e-6)
        assert entry.rank == int((logprobs[i] >= logprobs[i, targets[i]]).sum())
        assert [t for t, _ in entry.top] == logprobs[i].topk(4).indices.tolist()


def test_a_recomputed_chunk_does_not_repeat_scores() -> None:
    request = Request(EngineRequest("r", [5, 6, 7, 8, 9], SamplingParams(prompt_logprobs=0)), 4, frozenset())
    assert request.prompt_logprob_targets(0, 3) == [6, 7, 8]
    request.add_prompt_logprobs(0, [TokenLogprobs(-1.0), TokenLogprobs(-2.0), TokenLogprobs(-3.0)])
    assert request.prompt_logprob_targets(3, 5) == [9]  # the last position scores no prompt token
    # After a preemption the prompt is computed again from position 0: nothing is added twice.
    request.add_prompt_logprobs(0, [TokenLogprobs(-1.0), TokenLogprobs(-2.0)])
    request.add_prompt_logprobs(2, [TokenLogprobs(-3.0), TokenLogprobs(-4.0)])
    assert request.take_prompt_logprobs() == [None, *(TokenLogprobs(v) for v in (-1.0, -2.0, -3.0, -4.0))]
    assert request.take_prompt_logprobs() is None  # sent once
    assert request.prompt_logprob_targets(0, 5) == []
