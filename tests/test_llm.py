"""The offline API on the real default model: sampling, seeds, n, logprobs, stop strings, abort."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tokenline import LLM, SamplingParams

PROMPTS = ["Tell me a story about a dragon.", "List some fruits:", "The weather today is", "In 1969,"]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    # float32 so that batch composition cannot move a near-tie between two tokens.
    engine = LLM(default_model_dir, dtype="float32", kv_cache_memory_gib=0.25)
    engine.engine.check_integrity_every_step = True
    return engine


def assert_pool_empty(llm: LLM) -> None:
    pool = llm.engine.kv_cache.pool
    llm.engine.scheduler.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_seeded_sampling_is_the_same_alone_and_in_a_mixed_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.8, max_tokens=30),  # unseeded
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=1.2, top_k=20, seed=7, max_tokens=16),
    ]
    mixed = llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]], [others[0], others[1], seeded, others[2]])
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=24)
    assert llm.generate([PROMPTS[0]], other_seed)[0].outputs[0].token_ids != alone
    assert_pool_empty(llm)


def test_n_sequences_logprobs_and_usage_fields(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=3)
    (result,) = llm.generate(PROMPTS[1], params)
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1  # distinct samples
    for output in result.outputs:
        assert len(output.logprobs) == len(output.token_ids)
        for token_id, entry in zip(output.token_ids, output.logprobs):
            assert entry.logprob <= 0.0 and len(entry.top) == 3
            values = [v for _, v in entry.top]
            assert values == sorted(values, reverse=True)
            assert entry.logprob <= values[0] + 1e-6
            if token_id in {t for t, _ in entry.top}:
                assert math.isclose(dict(entry.top)[token_id], entry.logprob, abs_tol=1e-5)
        assert output.timings.first_token is not None and output.timings.finished >= output.timings.first_token
    assert_pool_empty(llm)


def test_greedy_top_logprob_is_the_chosen_token(llm: LLM) -> None:
    (result,) = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, logprobs=1))
    output = result.outputs[0]
    assert [e.top[0][0] for e in output.logprobs] == output.token_ids


def test_stop_string_ends_generation_and_is_not_in_the_text(llm: LLM) -> None:
    free = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert " 6" in free.text
    stop = " 6"
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    kept = llm.generate(
        "Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]
    assert len(out.token_ids) < len(free.token_ids)  # the engine stopped early, not just the text
    assert_pool_empty(llm)


def test_min_tokens_ignore_eos_and_length(llm: LLM) -> None:
    chat = [{"role": "user", "content": "Say just: yes"}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == 2  # EOS from generation_config
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(short.token_ids) + 3))
    assert len(longer[0].outputs[0].token_ids) >= len(short.token_ids) + 3
    forced = llm.chat(chat, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert len(forced.token_ids) == 12 and forced.finish_reason == "length"


def test_penalties_and_logit_bias_change_the_output(llm: LLM) -> None:
    prompt = "Repeat after me: the the the the the"
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].token_ids
    penalised = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5))
    assert penalised[0].outputs[0].token_ids != plain
    banned = plain[0]
    biased = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, logit_bias={banned: -100}))
    assert banned not in biased[0].outputs[0].token_ids
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logit_bias={42: 100}))
    assert forced[0].outputs[0].token_ids == [42, 42, 42]


def test_mix_of_finished_aborted_and_preempted_requests_returns_every_block(default_model_dir: Path) -> None:
    llm = LLM(default_model_dir, dtype="bfloat16", num_kv_blocks=12, block_size=4, check_integrity_every_step=True)
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=30, stop=["e"]),  # stop string: aborted early
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0.7, max_tokens=30, n=2, ignore_eos=True),
    ]
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.stats().num_preemptions > 0
    assert outputs[1].outputs[0].finish_reason == "stop" and "e" not in outputs[1].outputs[0].text
    assert outputs[2].outputs[0].finish_reason == "length"
    assert_pool_empty(llm)


def test_bad_input_is_refused_clearly(llm: LLM) -> None:
    from tokenline.frontend.processor import PromptError
    from tokenline.sampling_params import SamplingParamsError

    with pytest.raises(PromptError, match="context"):
        llm.generate([1] * 10, SamplingParams(max_tokens=llm.engine.max_model_len))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10**9]])
    with pytest.raises(SamplingParamsError):
        SamplingParams(top_p=0.0)
    assert not llm.engine.has_unfinished_requests()
    assert_pool_empty(llm)
