"""N-gram speculative decoding on the real default model: greedy outputs are token for token the
same as without it, in float32 and bfloat16, whatever else shares the batch, with preemptions,
with the prefix cache, and when a stop lands inside a run of accepted drafts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tokenline import LLM, SamplingParams
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineRequest
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.spec_decode.ngram_proposer import NgramProposer
from tokenline.spec_decode.suffix_proposer import SuffixProposer

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens, and wrote the weather in a leather logbook.",
    "To make the bread, mix the flour with warm water and a pinch of salt, knead the dough for ten minutes, "
    "then leave it to rise under a damp cloth until it has doubled in size.",
]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM(default_model_dir, dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> dict[str, list[int]]:
    """Prompts where the model copies a passage (drafts get accepted) and random ones (they don't)."""
    tokenizer = llm.tokenizer
    out = {}
    for i, passage in enumerate(PASSAGES):
        chat = [{"role": "user", "content": f"Repeat the following text exactly:\n\n{passage}"}]
        out[f"repeat{i}"] = tokenizer.encode(tokenizer.apply_chat_template(chat), add_special_tokens=False)
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(tokenizer.vocab_size) if i not in special]
    for i in range(2):
        out[f"random{i}"] = [rng.choice(ordinary) for _ in range(24)]
    out["story"] = tokenizer.encode("Once upon a time, in a small village at the edge of a great forest,")
    return out


@pytest.fixture(scope="module")
def expected(llm: LLM, prompts: dict[str, list[int]]) -> list[list[int]]:
    """Plain greedy float32 outputs (batch-invariant in float32, and equal to HF's: see
    test_greedy_parity)."""
    use_engine(llm, speculative=False)
    return generate(llm, list(prompts.values()), [GREEDY] * len(prompts))


def use_engine(
    llm: LLM, speculative: bool, num_blocks: int = 128, block_size: int = 16, prefix: bool = False,
    fills_pool: bool = True, method: str = "ngram",
) -> None:
    """A fresh engine around the loaded model, with or without the proposer (n-gram, or "suffix")."""
    runner = llm.engine.runner
    runner.allocate_kv_cache(num_blocks, block_size)
    llm.engine = EngineCore(
        runner,
        KVCacheManager(num_blocks, block_size, prefix, cache_resident_blocks=None if fills_pool else 0),
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=runner.max_model_len),
        eos_token_ids=runner.config.eos_token_ids,
        check_integrity_every_step=True,
        proposer=(SuffixProposer(8) if method == "suffix" else NgramProposer(4, 2, 4)) if speculative else None,
    )


def generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def assert_pool_empty(llm: LLM) -> None:
    pool = llm.engine.kv_cache.pool
    llm.engine.scheduler.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def both_ways(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], **engine: object) -> list[list[int]]:
    """Generate without and with speculation on fresh engines; assert the same tokens; return them."""
    use_engine(llm, speculative=False, **engine)
    expected = generate(llm, prompts, params)
    assert_pool_empty(llm)
    use_engine(llm, speculative=True, **engine)
    assert generate(llm, prompts, params) == expected
    assert_pool_empty(llm)
    return expected


def test_float32_same_greedy_tokens_and_drafts_get_accepted(
    llm: LLM, prompts: dict[str, list[int]], expected: list[list[int]]
) -> None:
    use_engine(llm, speculative=True)
    assert generate(llm, list(prompts.values()), [GREEDY] * len(prompts)) == expected
    assert_pool_empty(llm)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_bfloat16_same_greedy_tokens_up_to_near_ties(
    default_model_dir: Path, llm: LLM, prompts: dict[str, list[int]]
) -> None:
    """bfloat16 logits are coarse (about 0.1 at the usual magnitudes) and a span of 1 + k tokens
    does not round like a one-token decode; nor, for that matter, does a batch of 8 like a batch
    of 1, so the plain engine's own bf16 outputs already depend on the batch. So: the passages are
    copied token for token, and any other prompt may only part where the model hesitates between
    two tokens (float32 puts them within 0.5 nats of each other)."""
    spec = LLM(default_model_dir, dtype="bfloat16", num_kv_blocks=64, speculative="ngram",
               check_integrity_every_step=True)  # through EngineConfig, as `--speculative ngram`
    ids = list(prompts.values())
    got = generate(spec, ids, [GREEDY] * len(ids))
    assert spec.engine.stats().spec_decode_num_accepted_tokens > 0
    assert_pool_empty(spec)
    use_engine(spec, speculative=False, num_blocks=64)
    expected = generate(spec, ids, [GREEDY] * len(ids))
    for name, prompt, a, b in zip(prompts, ids, got, expected):
        if name.startswith("repeat"):
            assert a == b, name
        elif a != b:
            i = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
            use_engine(llm, speculative=False)
            judge = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
            top = dict(llm.generate([prompt + b[:i]], judge)[0].outputs[0].logprobs[0].top)
            assert a[i] in top and b[i] in top and abs(top[a[i]] - top[b[i]]) < 0.5, (name, i, top)


def test_mixed_batch_with_seeded_sampling_and_logprobs(llm: LLM, prompts: dict[str, list[int]]) -> None:
    ids = list(prompts.values())
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=MAX_TOKENS),  # greedy, but no drafts
        SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS),
        GREEDY,
    ]
    both_ways(llm, ids, params)
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_tiny_kv_pool_forces_preemptions(llm: LLM, prompts: dict[str, list[int]], expected: list[list[int]]) -> None:
    use_engine(llm, speculative=True, num_blocks=40, block_size=4)
    assert generate(llm, list(prompts.values()), [GREEDY] * len(prompts)) == expected
    assert_pool_empty(llm)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_prefix_cache_on(llm: LLM, prompts: dict[str, list[int]], expected: list[list[int]]) -> None:
    ids = list(prompts.values())
    # Every freed prefix stays while the pool has room (by default cached blocks are evicted
    # before untouched ones, and each pass would evict the next prompt's prefix).
    use_engine(llm, speculative=True, num_blocks=256, block_size=4, prefix=True, fills_pool=True)
    assert generate(llm, ids, [GREEDY] * len(ids)) == expected
    # Again on the same engine: prompt blocks come from the cache now, and with them the blocks
    # written through accepted drafts (prompt + output as the new prompt).
    outputs = llm.generate(ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.num_cached_tokens > 0 for o in outputs)
    longer = [p + out[:10] for p, out in zip(ids, expected)]
    again = llm.generate(longer, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - 10))
    assert [o.outputs[0].token_ids for o in again] == [out[10:] for out in expected]
    assert all(o.num_cached_tokens >= (len(p) - 1) // 4 * 4 - 4 for o, p in zip(again, longer))
    assert_pool_empty(llm)


def test_stops_inside_accepted_drafts(llm: LLM, prompts: dict[str, list[int]]) -> None:
    """Drive the engine directly to see each step's chunk of tokens: EOS, a stop token id and
    max_tokens land inside runs of accepted drafts, and the tokens after them are dropped."""
    prompt = prompts["repeat0"]
    use_engine(llm, speculative=False)
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64))[0].outputs[0]
    # The model copies the passage, then ends its turn with EOS, as the prompt's own turn did.
    assert full.finish_reason == "stop" and len(full.token_ids) < 64
    ids = full.token_ids
    params = {f"max{n}": SamplingParams(temperature=0.0, max_tokens=n) for n in range(3, 9)}
    # One request per token that first occurs at position i (a few of them): it stops right there.
    firsts = [i for i in range(1, len(ids) - 1) if ids[i] not in ids[:i]][1::3]
    for i in firsts:
        params[f"stop{i}"] = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[ids[i]])
    params["eos"] = SamplingParams(temperature=0.0, max_tokens=64)

    use_engine(llm, speculative=True)
    engine = llm.engine
    for rid, p in params.items():
        engine.add_request(EngineRequest(rid, prompt, p.with_defaults(llm.generation_config)))
    chunks: dict[str, list[list[int]]] = {rid: [] for rid in params}
    finish: dict[str, str] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            chunks[out.request_id].append(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason.value
    flat = {rid: [t for c in cs for t in c] for rid, cs in chunks.items()}
    for n in range(3, 9):
        assert flat[f"max{n}"] == ids[:n] and finish[f"max{n}"] == "length"
    for i in firsts:
        assert flat[f"stop{i}"] == ids[: i + 1] and finish[f"stop{i}"] == "stop"
    assert flat["eos"] == ids and finish["eos"] == "stop"
    # The stops came in steps that produced several tokens, from accepted drafts; some stop ids
    # cut such a step short (the step would have given more tokens without the stop).
    assert len(chunks["eos"][-1]) > 1
    step_ends = {sum(map(len, chunks["eos"][: j + 1])) for j in range(len(chunks["eos"]))}
    assert any(len(chunks[f"stop{i}"][-1]) > 1 and i + 1 not in step_ends for i in firsts)
    assert engine.stats().spec_decode_num_accepted_tokens >= len(ids)
    assert_pool_empty(llm)

    # A stop string (the frontend's) inside a multi-token step: same text and same ids.
    stop = SamplingParams(temperature=0.0, max_tokens=64, stop=["great lens"])
    got = llm.generate([prompt], stop)[0].outputs[0]
    use_engine(llm, speculative=False)
    want = llm.generate([prompt], stop)[0].outputs[0]
    assert "great lens" not in want.text and want.finish_reason == "stop"
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
