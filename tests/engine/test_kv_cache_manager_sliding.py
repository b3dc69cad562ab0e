"""KV cache groups with sliding windows: one pool, per-group tables, blocks freed as the window moves.

Layout under test (model/kv_groups.py): group 0 full attention, groups 1.. sliding with a window of
WINDOW positions, block size BS.
"""

from __future__ import annotations

import pytest

from tests.engine.fake_runner import FakeRunner
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import NULL_BLOCK, KVCacheManager, PrefixHit
from tokenline.engine.messages import EngineRequest
from tokenline.engine.request import Request
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.model.config import ModelConfig
from tokenline.model.kv_groups import kv_groups, sliding_blocks_needed
from tokenline.sampling_params import SamplingParams

BS = 4
WINDOW = 10
WINDOWS = (None, WINDOW, WINDOW)  # one full group, two sliding ones


def request(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(EngineRequest(rid, tokens, SamplingParams(max_tokens=max_tokens)), max_tokens, frozenset())


def manager(num_blocks: int = 64, prefix: bool = True, chunk: int | None = None) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, prefix, group_windows=WINDOWS, max_chunk_tokens=chunk)


def step(kv: KVCacheManager, req: Request, n: int) -> None:
    """Schedule n tokens of the request and mark them computed (as the scheduler's update does)."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)
    kv.check_integrity()


def visible_blocks(position: int) -> int:
    """Sliding blocks a query at ``position`` needs: those holding positions > position - WINDOW."""
    first = max(0, position - WINDOW + 1) // BS
    return position // BS + 1 - first


def test_groups_of_equal_size_gemma3_270m_shape() -> None:
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    config = ModelConfig("LlamaForCausalLM", 100, 64, 128, 18, 4, 1, 16, 1e-6, 1e4, 4096, True,
                         layer_types=types, sliding_window=512)
    groups = kv_groups(config)
    assert [g.window for g in groups] == [None] + [512] * 5
    assert [len(g.layers) for g in groups] == [3] * 6
    assert sorted(i for g in groups for i in g.layers) == list(range(18))
    assert groups[0].layers == (5, 11, 17)


def test_decode_frees_blocks_that_leave_the_window() -> None:
    kv = manager()
    req = request("a", list(range(1, 7)), max_tokens=200)
    step(kv, req, 6)
    for _ in range(60):  # decode, one token a step
        req.token_ids.append(7)
        step(kv, req, 1)
        full, *sliding = kv.block_tables("a")
        assert NULL_BLOCK not in full and len(full) == -(-req.num_computed_tokens // BS)
        for table in sliding:
            held = [b for b in table if b != NULL_BLOCK]
            # Only the blocks the step's query (the last computed position) saw, at most window/bs + 1.
            assert len(held) == visible_blocks(req.num_computed_tokens - 1) <= sliding_blocks_needed(WINDOW, BS)
    # 66 tokens: full holds 17 blocks, each sliding group at most ceil(10/4)+1 = 4.
    assert kv.num_blocks_held("a") <= 17 + 2 * 4
    assert kv.pool.num_used_blocks == kv.num_blocks_held("a")
    kv.free(req)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_freed_blocks_are_reused_by_others() -> None:
    """The sliding groups' returned blocks come back to the shared pool: a long decode in a tiny pool."""
    kv = manager(num_blocks=20, prefix=False)
    req = request("a", [1, 2, 3], max_tokens=200)
    step(kv, req, 3)
    for _ in range(40):  # 43 tokens: 11 full blocks + 2 x 4 sliding = 19 <= 20, all-global would need 33
        req.token_ids.append(5)
        step(kv, req, 1)
    assert kv.pool.num_used_blocks <= 19


def test_chunked_prefill_holds_the_window_before_the_chunk() -> None:
    kv = manager()
    req = request("a", list(range(1, 41)))
    for start in range(0, 40, 6):  # chunks smaller than the window
        n = min(6, 40 - start)
        assert kv.allocate_slots(req, n)
        first_needed = max(0, start - WINDOW + 1) // BS  # the chunk's first query sees back to here
        for table in kv.block_tables("a")[1:]:
            assert all(b != NULL_BLOCK for b in table[first_needed:])
            assert all(b == NULL_BLOCK for b in table[:first_needed])
            assert len(table) == -(-(start + n) // BS)
        req.num_computed_tokens += n
        kv.check_integrity()


def test_can_fit_counts_both_kinds_and_what_the_window_gives_back() -> None:
    # A 20-token prompt (and the next token) in one chunk: 6 blocks in each of the three groups.
    req = request("a", list(range(1, 21)))
    assert not manager(num_blocks=17).can_fit(req, 21) and manager(num_blocks=18).can_fit(req, 21)
    # Admission with chunks of 4: a sliding group never holds more than ceil((10 - 1 + 4) / 4) + 1 = 5.
    assert not manager(num_blocks=15, chunk=4).can_fit(req, 21) and manager(num_blocks=16, chunk=4).can_fit(req, 21)
    # Decoding at position 40 with the window's blocks freed: can_fit counts the blocks it gives back.
    kv = manager(num_blocks=19, prefix=False)
    req = request("b", list(range(1, 41)), max_tokens=100)
    for _ in range(10):
        step(kv, req, 4)
    used = kv.pool.num_used_blocks  # 10 full + 2 x 3 sliding
    assert used == 10 + 2 * visible_blocks(40)
    assert kv.pool.num_free_blocks == 19 - used
    req.token_ids.extend([1] * 8)
    # 4 more tokens: one more full block, each sliding group one new block for the one it gives back.
    assert kv.can_fit(req, 44) and not kv.can_fit(req, 48)
    step(kv, req, 4)
    assert kv.pool.num_used_blocks == 19


def test_prefix_hit_needs_only_the_window_at_the_hit_point() -> None:
    kv = manager()
    prompt = list(range(1, 42))  # 41 tokens: 10 full blocks can be hit
    a = request("a", prompt)
    for _ in range(10):
        step(kv, a, 4)
    step(kv, a, 1)
    kv.free(a)
    b = request("b", prompt + [99, 98])  # 43 tokens: up to 10 blocks (40 tokens)
    hit = kv.find_cached_prefix(b)
    assert isinstance(hit, PrefixHit) and len(hit) == 10
    full, *sliding = hit.groups
    assert NULL_BLOCK not in full
    first = max(0, 40 - WINDOW + 1) // BS
    for table in sliding:
        assert table[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in table[first:]
    assert kv.allocate_slots(b, 3, hit)
    kv.check_integrity()
    assert kv.block_tables("b")[0][:10] == full


def test_prefix_hit_is_cut_where_a_sliding_group_lost_its_blocks() -> None:
    kv = manager()
    prompt = list(range(1, 42))
    a = request("a", prompt)
    for _ in range(10):
        step(kv, a, 4)
    step(kv, a, 1)
    kv.free(a)
    # Evict group 2's copy of block 8 (it covers positions 32..35, inside the window at 40).
    key = (2, a.block_hashes[8])
    victim = kv.pool._cached[key]
    kv.pool._lru.pop(victim)
    kv.pool._evict(victim)
    kv.pool._spare[victim] = None
    kv.check_integrity()
    hit = kv.find_cached_prefix(request("b", prompt + [99]))
    # 10 blocks would need block 8 in group 2; the deepest hit whose window lacks nothing is 8 blocks.
    assert len(hit) == 8


def test_kv_events_name_group_zero_only() -> None:
    kv = KVCacheManager(64, BS, True, enable_kv_cache_events=True, group_windows=WINDOWS)
    a = request("a", list(range(1, 14)))
    step(kv, a, 13)
    events = kv.pool.take_events()
    stored = [h for e in events for h in getattr(e, "block_hashes", [])]
    assert stored == a.block_hashes[:3]
    assert kv.pool.cached_hashes() == set(a.block_hashes[:3])


def engine(num_blocks: int, budget: int, chunk: int | None = None) -> EngineCore:
    return EngineCore(
        FakeRunner(),
        KVCacheManager(num_blocks, BS, True, group_windows=WINDOWS, max_chunk_tokens=chunk or budget),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256),
        eos_token_ids=[0],
        check_integrity_every_step=True,
    )


@pytest.mark.parametrize("num_blocks", [32, 60])
def test_engine_preempts_and_readmits_with_sliding_groups(num_blocks: int) -> None:
    core = engine(num_blocks, budget=16)
    for i in range(6):
        core.add_request(EngineRequest(f"r{i}", [1 + i] * (10 + 5 * i), SamplingParams(max_tokens=20, ignore_eos=True)))
    outputs: dict[str, int] = {}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            outputs[out.request_id] = outputs.get(out.request_id, 0) + len(out.new_token_ids)
    assert not core.has_unfinished_requests()
    assert outputs == {f"r{i}": 20 for i in range(6)}
    core.scheduler.check_integrity()
    assert core.kv_cache.pool.num_free_blocks == num_blocks
    if num_blocks == 32:
        assert core.scheduler.num_preemptions > 0


def test_one_group_keeps_the_plain_list() -> None:
    kv = KVCacheManager(16, BS, True)
    a = request("a", list(range(1, 10)))
    step(kv, a, 9)
    kv.free(a)
    hit = kv.find_cached_prefix(request("b", list(range(1, 10))))
    assert isinstance(hit, list) and len(hit) == 2
    assert kv.block_tables("b") == []


def test_a_4096_token_sequence_holds_the_issue_target_gemma3_270m() -> None:
    """Gemma 3 270M's layout (6 groups of 3 layers: 1 global, 5 with a 512 window), block 16: a
    4,096-token sequence prefilled in 512-token chunks then decoded holds at most
    (1/6 + 5/6 x 512/4096) x the all-global figure + one block per layer; the pool's usage, what
    /metrics reports as vllm:kv_cache_usage_perc, counts the blocks of both kinds."""
    block, window = 16, 512
    kv = KVCacheManager(2000, block, True, group_windows=[None] + [window] * 5, max_chunk_tokens=512)
    req = request("a", [1 + i % 1000 for i in range(3584)], max_tokens=600)
    for _ in range(7):
        assert kv.allocate_slots(req, 512)
        req.num_computed_tokens += 512
        kv.cache_full_blocks(req)
    while req.num_tokens < 4096:
        req.token_ids.append(3)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        kv.cache_full_blocks(req)
    kv.check_integrity()
    all_global = 6 * 4096 // block  # pool blocks (3 layers x 16 tokens each) with every layer global
    held = kv.num_blocks_held("a")
    assert held <= (1 / 6 + 5 / 6 * window / 4096) * all_global + 18 / 3  # + one block per layer
    # The last query (position 4095) sees 3584.., blocks 224..255: 32 per sliding group.
    assert held == 256 + 5 * 32
    assert kv.usage() == kv.pool.num_used_blocks / 2000 == held / 2000
