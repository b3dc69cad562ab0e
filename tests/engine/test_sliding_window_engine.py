"""A model with sliding-window and global layers through the whole engine: greedy tokens equal
transformers' (which masks the same window over a dense cache) on prompts shorter and longer than
the window, alone, batched, in chunks smaller than the window, under preemption and with prefix
hits, while the sliding layers' blocks go back to the pool as the window moves on."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager
from tokenline.engine.messages import EngineRequest
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.model.kv_groups import kv_groups
from tokenline.model.runner import ModelRunner
from tokenline.sampling_params import SamplingParams

WINDOW = 16
BLOCK = 4
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenline.model.random_models import make_sliding_tiny

    out = tmp_path_factory.mktemp("sliding") / "sliding-tiny"
    make_sliding_tiny(out, seed=0, window=WINDOW)
    return out


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, torch.float32)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 1024) for _ in range(n)] for n in (5, 13, 40, 70)]


def hf_greedy(model_dir: Path, prompts: list[list[int]], sliding: bool = True) -> list[list[int]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if not sliding:  # the same weights, every layer global: what a window that does nothing gives
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            generated = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
            )
            out.append(generated[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(model_dir, prompts)


def make_engine(runner: ModelRunner, num_blocks: int, budget: int = 2048, max_seqs: int = 8) -> EngineCore:
    runner.allocate_kv_cache(num_blocks, BLOCK)
    kv = KVCacheManager(num_blocks, BLOCK, True, group_windows=runner.kv_group_windows, max_chunk_tokens=budget)
    return EngineCore(
        runner, kv,
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=1024),
        check_integrity_every_step=True,
    )


def generate(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True).with_defaults()
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}-{id(prompt)}-{len(prompt)}", prompt, params))
    tokens: dict[str, list[int]] = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
    return [tokens[f"r{i}-{id(p)}-{len(p)}"] for i, p in enumerate(prompts)]


def test_groups_of_the_test_model(runner: ModelRunner) -> None:
    groups = kv_groups(runner.config)
    assert [(g.window, g.layers) for g in groups] == [(None, (2, 5)), (WINDOW, (0, 1)), (WINDOW, (3, 4))]


def test_the_window_changes_the_tokens(model_dir: Path, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """Without it this file could not fail: past the window, global attention picks other tokens."""
    assert hf_greedy(model_dir, prompts[2:], sliding=False) != reference[2:]


@pytest.mark.parametrize("budget", [2048, 7], ids=["whole", "chunks-of-7"])
def test_alone_matches_transformers(runner: ModelRunner, prompts: list[list[int]], reference: list[list[int]],
                                    budget: int) -> None:
    engine = make_engine(runner, 512, budget=budget, max_seqs=1)
    assert generate(engine, prompts) == reference


def test_batched_matches_transformers(runner: ModelRunner, prompts: list[list[int]],
                                      reference: list[list[int]]) -> None:
    engine = make_engine(runner, 512, budget=11)  # chunks smaller than the window beside decodes
    assert generate(engine, prompts) == reference


def test_decode_returns_sliding_blocks_to_the_pool(runner: ModelRunner, prompts: list[list[int]],
                                                   reference: list[list[int]]) -> None:
    engine = make_engine(runner, 512, max_seqs=1)
    kv = engine.kv_cache
    sliding_held: list[int] = []
    original = kv.allocate_slots

    def watch(request, num_new, cached=()):  # type: ignore[no-untyped-def]
        ok = original(request, num_new, cached)
        tables = kv.block_tables(request.request_id)
        for table in tables[1:]:
            assert sum(b != NULL_BLOCK for b in table) <= -(-(WINDOW - 1 + num_new) // BLOCK) + 1
        sliding_held.append(kv.pool.num_used_blocks - len(tables[0]))
        return ok

    kv.allocate_slots = watch  # type: ignore[method-assign]
    assert generate(engine, [prompts[3]]) == [reference[3]]
    # 94 tokens: the two sliding groups end with at most 2 x (16 / 4 + 1) blocks; all-global: 2 x 24.
    assert sliding_held[-1] <= 2 * (WINDOW // BLOCK + 1)
    assert kv.pool.num_free_blocks == 512


def test_preemption_matches_transformers(runner: ModelRunner, prompts: list[list[int]],
                                         reference: list[list[int]]) -> None:
    engine = make_engine(runner, 48, budget=16)
    assert generate(engine, prompts) == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.pool.num_free_blocks == 48


def test_prefix_hits_match_transformers(runner: ModelRunner, model_dir: Path, prompts: list[list[int]],
                                        reference: list[list[int]]) -> None:
    engine = make_engine(runner, 512)
    long = prompts[3]
    assert generate(engine, [long]) == [reference[3]]
    # The same prompt again, then one that shares 48 of its tokens: hits well past the window.
    assert generate(engine, [long]) == [reference[3]]
    assert engine.kv_cache.prefix_stats.hits == 68  # 17 blocks of the 70-token prompt
    branch = long[:48] + [7, 8, 9, 10, 11]
    assert generate(engine, [branch]) == hf_greedy(model_dir, [branch])
    assert engine.kv_cache.prefix_stats.hits == 68 + 48


def test_one_table_for_every_group_is_refused(runner: ModelRunner, prompts: list[list[int]]) -> None:
    """Layers of different groups share KV tensors: a manager without the groups would mix their KV."""
    runner.allocate_kv_cache(64, BLOCK)
    engine = EngineCore(runner, KVCacheManager(64, BLOCK, True), SchedulerConfig(max_model_len=1024))
    with pytest.raises(RuntimeError, match="a table per KV cache group"):
        generate(engine, prompts[:1])
