"""The routing policies' decisions on constructed replica states and token prompts, and the
precise policy fed by vLLM's own KV event bytes (fixtures made by vLLM 0.32's encoder with
``fixtures/make_vllm_kv_events.py``), directly and over a real ZMQ socket."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq

from tests.engine.fake_runner import FakeRunner
from tokenline.bench.ports import free_port
from tokenline.engine.block_pool import BlockPool, hash_block, salt_root
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_event_batch
from tokenline.engine.kv_events_zmq import KVEventSubscriber
from tokenline.engine.messages import EngineRequest
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.router.policies import (
    POLICY_NAMES,
    ApproximatePrefix,
    LeastLoad,
    PreciseKV,
    RoundRobin,
    SessionAffinity,
    block_chain,
    make_policy,
)
from tokenline.router.policy import REASONS, ReplicaState, RouteDecision, RouteRequest, RoutingPolicy
from tokenline.sampling_params import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
B = 16  # block size


def replicas(*loads: int, block_size: int = B) -> list[ReplicaState]:
    """Replicas r0, r1, ... with the given loads (as num_running)."""
    return [ReplicaState(f"r{i}", num_running=n, block_size=block_size) for i, n in enumerate(loads)]


def prompt(seed: int, blocks: int, shared: list[int] | None = None) -> list[int]:
    """``shared`` followed by ``blocks`` full blocks of tokens unique to ``seed``."""
    return (shared or []) + [1000 * seed + i for i in range(blocks * B)]


def route(policy: RoutingPolicy, request: RouteRequest, states: list[ReplicaState]) -> RouteDecision:
    """choose + on_routed, as a fleet does."""
    decision = policy.choose(request, states)
    assert decision.reason in REASONS
    assert decision.replica in {s.name for s in states}
    policy.on_routed(request, decision)
    return decision


# --- round robin, least load, make_policy ------------------------------------------------------


def test_round_robin_is_fair_and_keeps_its_turn_when_replicas_change() -> None:
    policy = RoundRobin()
    states = replicas(0, 0, 0)
    chosen = [route(policy, RouteRequest(f"q{i}"), states).replica for i in range(30)]
    assert Counter(chosen) == {"r0": 10, "r1": 10, "r2": 10}
    assert chosen[:4] == ["r0", "r1", "r2", "r0"]
    assert policy.choose(RouteRequest("w"), states).replica == "r0"
    # r1 leaves after r0 was chosen: the turn goes on to r2, not back to r0 or skipping ahead.
    assert policy.choose(RouteRequest("x"), [states[0], states[2]]).replica == "r2"
    # Order of the list handed in does not matter.
    assert policy.choose(RouteRequest("y"), list(reversed(states))).replica == "r0"


def test_least_load_power_of_two_choices() -> None:
    policy = LeastLoad(seed=1)
    # Of two replicas both are always compared: the lighter wins; KV usage counts kv_weight.
    two = [ReplicaState("a", num_running=3), ReplicaState("b", num_running=1, num_waiting=1, in_flight=2)]
    assert policy.choose(RouteRequest("q"), two).replica == "a"  # 3 < 4
    full = [ReplicaState("a", num_running=3, kv_cache_usage=1.0), ReplicaState("b", num_running=4)]
    assert policy.choose(RouteRequest("q"), full) == RouteDecision("b", "least_load")  # 3 + 8 > 4
    # Many replicas: never the single heaviest (it loses every pair it is drawn into), and the
    # idle one wins whenever drawn — spread, not herded.
    states = [ReplicaState(f"r{i}", num_running=10) for i in range(7)] + [ReplicaState("busy", num_running=99),
                                                                          ReplicaState("idle")]
    chosen = Counter(policy.choose(RouteRequest(f"q{i}"), states).replica for i in range(900))
    assert "busy" not in chosen
    assert 150 < chosen["idle"] < 260  # drawn in 2 of 9: about 200
    assert len(chosen) == 8
    # Seeded: repeatable.
    a, b = LeastLoad(seed=7), LeastLoad(seed=7)
    assert [a.choose(RouteRequest("q"), states).replica for _ in range(50)] == \
        [b.choose(RouteRequest("q"), states).replica for _ in range(50)]


def test_make_policy_names_and_errors() -> None:
    assert POLICY_NAMES == ("round_robin", "least_load", "prefix", "kv_events")
    for name in POLICY_NAMES:
        policy = make_policy(name, seed=3)
        assert policy.name == name
        assert policy.choose(RouteRequest("q", token_ids=list(range(40))), replicas(0, 1)).reason in REASONS
    assert isinstance(make_policy("prefix", cache_threshold=0.5), ApproximatePrefix)
    assert make_policy("prefix", cache_threshold=0.5).cache_threshold == 0.5
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'; choose one of: round_robin, least_load"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="bad option for routing policy 'round_robin'"):
        make_policy("round_robin", cache_threshold=0.1)


# --- approximate prefix (SGLang's cache-aware router) --------------------------------------------


def test_approximate_prefix_follows_a_routed_prefix() -> None:
    policy = ApproximatePrefix()
    states = replicas(0, 0, 0)
    system = prompt(1, 8)
    first = route(policy, RouteRequest("a", token_ids=system + prompt(2, 2)), states)
    assert first == RouteDecision("r0", "smallest_tree")  # all empty: load, then name
    assert policy.tree_size("r0") == 10
    # A second conversation on the same system prompt: 8 of 10 blocks match there.
    states = [ReplicaState("r0", num_running=5), *replicas(0, 0)[1:]]
    second = route(policy, RouteRequest("b", token_ids=system + prompt(3, 2) + [9, 9, 9]), states)
    assert second == RouteDecision("r0", "prefix", 8 * B)
    # Something new goes to the smallest tree, not the loaded-but-warm one.
    assert route(policy, RouteRequest("c", token_ids=prompt(4, 4)), states).reason == "smallest_tree"
    assert policy.tree_size("r0") == 12


def test_approximate_prefix_cache_threshold_is_strict() -> None:
    policy = ApproximatePrefix()
    shared = prompt(1, 3)
    route(policy, RouteRequest("seed", token_ids=shared), replicas(0, 0))
    # r0 holds 3 blocks; r1 nothing. 3/10 = 0.3 is not > 0.3: the smallest tree (r1).
    assert policy.choose(RouteRequest("at", token_ids=shared + prompt(2, 7)), replicas(0, 0)) == \
        RouteDecision("r1", "smallest_tree")
    # 3/9 > 0.3: the prefix.
    assert policy.choose(RouteRequest("above", token_ids=shared + prompt(2, 6)), replicas(0, 0)) == \
        RouteDecision("r0", "prefix", 3 * B)
    # A partial last block does not count as a prompt block.
    assert policy.choose(RouteRequest("tail", token_ids=shared + prompt(2, 7) + [1] * (B - 1)),
                         replicas(0, 0)).reason == "smallest_tree"


@pytest.mark.parametrize(
    ("low", "high", "imbalanced"),
    [
        (128, 192, False),  # difference exactly 64 (> 64 is needed), ratio exactly 1.5
        (128, 193, True),  # difference 65 and 193 > 192
        (200, 300, False),  # difference 100 but ratio exactly 1.5
        (200, 301, True),
        (0, 64, False),  # difference exactly 64 from idle
        (0, 65, True),
        (10, 60, False),  # ratio 6 but difference only 50
    ],
)
def test_approximate_prefix_imbalance_thresholds(low: int, high: int, imbalanced: bool) -> None:
    policy = ApproximatePrefix()
    warm = prompt(1, 10)
    route(policy, RouteRequest("seed", token_ids=warm), replicas(0, 0))  # r0 holds the whole prompt
    states = [ReplicaState("r0", num_running=high), ReplicaState("r1", num_running=low // 2, in_flight=low - low // 2)]
    decision = policy.choose(RouteRequest("q", token_ids=warm), states)
    assert decision == (RouteDecision("r1", "imbalance") if imbalanced else RouteDecision("r0", "prefix", 10 * B))


def test_approximate_prefix_lru_evicts_leaves_first() -> None:
    policy = ApproximatePrefix(max_blocks_per_replica=10)
    only = replicas(0)
    a, b = prompt(1, 6), prompt(2, 6)
    route(policy, RouteRequest("a", token_ids=a), only)
    route(policy, RouteRequest("b", token_ids=b), only)  # 12 blocks > 10: a's two deepest go
    assert policy.tree_size("r0") == 10
    assert policy.choose(RouteRequest("a2", token_ids=a), only).predicted_hit_tokens == 4 * B
    assert policy.choose(RouteRequest("b2", token_ids=b), only).predicted_hit_tokens == 6 * B
    # Touching a's prefix again makes it recent: now b loses its deepest blocks.
    route(policy, RouteRequest("a3", token_ids=a[: 4 * B]), only)
    route(policy, RouteRequest("c", token_ids=prompt(3, 2)), only)
    assert policy.choose(RouteRequest("a4", token_ids=a), only).predicted_hit_tokens == 4 * B
    assert policy.choose(RouteRequest("b3", token_ids=b), only).predicted_hit_tokens == 4 * B


@pytest.mark.parametrize("num_kv_blocks", [0, 10])
def test_approximate_prefix_tree_holds_no_more_than_the_replica_cache(num_kv_blocks: int) -> None:
    policy = ApproximatePrefix()
    states = [ReplicaState("r0", num_kv_blocks=num_kv_blocks), ReplicaState("r1", num_kv_blocks=num_kv_blocks)]
    group = prompt(1, 6)
    assert route(policy, RouteRequest("a", token_ids=group), states) == RouteDecision("r0", "smallest_tree")
    # The fleet sends a long prompt to r0 anyway (a session, a retry): with a 10-block cache r0 must
    # have evicted the group's 6 blocks to make room for these 10.
    other = RouteRequest("b", token_ids=prompt(2, 10))
    policy.choose(other, states)
    policy.on_routed(other, RouteDecision("r0", "session"))
    again = policy.choose(RouteRequest("c", token_ids=group + prompt(3, 1)), states)
    if num_kv_blocks:
        assert policy.tree_size("r0") == num_kv_blocks
        assert again == RouteDecision("r1", "smallest_tree")  # placed again, not pinned to r0
    else:  # capacity unknown: the tree keeps everything up to max_blocks_per_replica
        assert policy.tree_size("r0") == 16
        assert again == RouteDecision("r0", "prefix", 6 * B)


def test_approximate_prefix_cap_is_the_smaller_of_option_and_cache() -> None:
    policy = ApproximatePrefix(max_blocks_per_replica=8)
    states = [ReplicaState("r0", num_kv_blocks=10)]
    route(policy, RouteRequest("a", token_ids=prompt(1, 12)), states)
    assert policy.tree_size("r0") == 8
    policy = ApproximatePrefix(max_blocks_per_replica=20)
    route(policy, RouteRequest("a", token_ids=prompt(1, 12)), states)
    assert policy.tree_size("r0") == 10


def test_approximate_prefix_groups_share_a_replica_each() -> None:
    policy = ApproximatePrefix()
    groups = [prompt(g, 8) for g in range(4)]
    states = replicas(0, 0, 0, 0)
    home: dict[int, set[str]] = {g: set() for g in range(4)}
    for i in range(40):
        g = i % 4
        decision = route(policy, RouteRequest(f"q{i}", token_ids=groups[g] + prompt(100 + i, 2)), states)
        home[g].add(decision.replica)
    assert all(len(r) == 1 for r in home.values())
    assert len(set().union(*home.values())) == 4  # one group per replica


def test_approximate_prefix_text_requests_and_forgetting() -> None:
    policy = ApproximatePrefix()
    text = "You are a helpful assistant. " * 20  # 580 characters: 9 blocks of 64
    route(policy, RouteRequest("a", text=text + "Hi"), replicas(0, 0))
    decision = policy.choose(RouteRequest("b", text=text + "Bye"), replicas(0, 0))
    assert decision == RouteDecision("r0", "prefix", 0)  # no tokens: no token prediction
    policy.on_kv_events("r0", [AllBlocksCleared()])
    assert policy.tree_size("r0") == 0
    route(policy, RouteRequest("c", text=text), replicas(0, 0))
    policy.remove_replica("r0")
    assert policy.choose(RouteRequest("d", text=text), replicas(0, 0)).reason == "smallest_tree"


# --- precise prefix from KV events --------------------------------------------------------------


def stored(tokens: list[int], parent: int | None, hashes: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, B, None, "GPU")


def test_precise_kv_routes_to_the_replica_holding_the_blocks_and_stops_after_eviction() -> None:
    policy = PreciseKV()
    tokens = prompt(1, 6)
    # vLLM-style int hashes that have nothing to do with ours.
    policy.on_kv_events("r1", [stored(tokens[: 4 * B], None, [11, 12, 13, 14]), stored(tokens[4 * B:], 14, [15, 16])])
    assert policy.cached_blocks("r1") == 6
    states = replicas(0, 0, 0)
    assert policy.choose(RouteRequest("q", token_ids=tokens + [5]), states) == RouteDecision("r1", "prefix", 6 * B)
    # A full hit is worth one queued request (a tie goes to the hit): r1 with one more still wins…
    busy = [ReplicaState("r0"), ReplicaState("r1", in_flight=1)]
    assert policy.choose(RouteRequest("q", token_ids=tokens), busy) == RouteDecision("r1", "prefix", 6 * B)
    # …but not with two.
    busier = [ReplicaState("r0"), ReplicaState("r1", num_running=1, num_waiting=1)]
    assert policy.choose(RouteRequest("q", token_ids=tokens), busier) == RouteDecision("r0", "least_load")
    # Evicting the deepest two: a partial hit. Evicting the first: the chain is broken at its root.
    policy.on_kv_events("r1", [BlockRemoved([15, 16], "GPU")])
    assert policy.choose(RouteRequest("q", token_ids=tokens), states).predicted_hit_tokens == 4 * B
    policy.on_kv_events("r1", [BlockRemoved([11])])
    assert policy.choose(RouteRequest("q", token_ids=tokens), states) == RouteDecision("r0", "no_prefix")
    # A child of an evicted (unknown) parent cannot be chained: skipped.
    policy.on_kv_events("r2", [stored(tokens[B : 2 * B], 11, [21])])
    assert policy.cached_blocks("r2") == 0


def test_precise_kv_all_blocks_cleared_and_remove_replica() -> None:
    policy = PreciseKV()
    tokens = prompt(1, 4)
    for name in ("r0", "r1"):
        policy.on_kv_events(name, [stored(tokens, None, [1, 2, 3, 4])])
    states = [ReplicaState("r0", num_running=1), ReplicaState("r1")]
    assert policy.choose(RouteRequest("q", token_ids=tokens), states) == RouteDecision("r1", "prefix", 4 * B)
    policy.on_kv_events("r1", [AllBlocksCleared()])
    assert policy.cached_blocks("r1") == 0
    assert policy.choose(RouteRequest("q", token_ids=tokens), states).replica == "r0"  # a tie: the hit
    policy.remove_replica("r0")
    assert policy.choose(RouteRequest("q", token_ids=tokens), states) == RouteDecision("r1", "no_prefix")
    # Events after a clear build afresh; other media and LoRA blocks are not the GPU cache's.
    policy.on_kv_events("r1", [AllBlocksCleared(), stored(tokens, None, [1, 2, 3, 4])])
    policy.on_kv_events("r0", [BlockStored([9], None, tokens[:B], B, None, "CPU"),
                               BlockStored([8], None, tokens[:B], B, 3, "GPU")])
    assert (policy.cached_blocks("r0"), policy.cached_blocks("r1")) == (0, 4)


def test_precise_kv_reads_our_own_block_pool_events() -> None:
    """Our engine's hashes are our keys already: the pool's real events route its prompts, and
    its real evictions stop it."""
    pool = BlockPool(num_blocks=4, enable_kv_cache_events=True)
    tokens = prompt(1, 3)
    blocks = pool.allocate(3)
    parent = None
    for index, block in enumerate(blocks):
        block_tokens = tokens[index * B : (index + 1) * B]
        key = hash_block(parent, block_tokens)
        pool.cache(block, key, parent, block_tokens)
        parent = key
    pool.free(reversed(blocks))  # tail first, as the cache manager frees
    policy = PreciseKV()
    policy.on_kv_events("r1", pool.take_events())
    assert policy.choose(RouteRequest("q", token_ids=tokens), replicas(0, 0)) == RouteDecision("r1", "prefix", 3 * B)
    pool.allocate(3)  # the never-used block first, then the freed tail: two cached blocks evicted
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockRemoved]
    policy.on_kv_events("r1", events)
    assert policy.choose(RouteRequest("q", token_ids=tokens), replicas(0, 0)) == RouteDecision("r1", "prefix", 1 * B)


def test_precise_kv_keys_salted_blocks_as_the_engine_does() -> None:
    """A salted prompt's blocks (its tenant's) attract that salt's requests only: the router chains
    the event's first block on the salt it names, and the request's chain on the request's salt."""
    pool = BlockPool(num_blocks=4, enable_kv_cache_events=True)
    tokens = prompt(1, 3)
    parent = salt_root("tenant-a")
    for index, block in enumerate(pool.allocate(3)):
        block_tokens = tokens[index * B : (index + 1) * B]
        key = hash_block(parent, block_tokens)
        pool.cache(block, key, None if index == 0 else parent, block_tokens, "tenant-a" if index == 0 else None)
        parent = key
    policy = PreciseKV()
    policy.on_kv_events("r1", pool.take_events())
    salted = RouteRequest("q", token_ids=tokens, cache_salt="tenant-a")
    assert policy.choose(salted, replicas(0, 0)) == RouteDecision("r1", "prefix", 3 * B)
    for other in (RouteRequest("b", token_ids=tokens, cache_salt="tenant-b"), RouteRequest("c", token_ids=tokens)):
        assert policy.choose(other, replicas(0, 0)).predicted_hit_tokens == 0
    # vLLM's events name the salt the same way; a first block with other extra keys (an image) is
    # nothing a text prompt can hit.
    policy.on_kv_events("r0", [BlockStored([7], None, tokens[:B], B, None, "GPU", None, [("tenant-b",)]),
                               BlockStored([8], None, prompt(2, 1), B, None, "GPU", None, [("img-uuid", "s")])])
    assert policy.choose(RouteRequest("b", token_ids=tokens, cache_salt="tenant-b"), replicas(0, 0)) == \
        RouteDecision("r0", "prefix", B)
    assert policy.cached_blocks("r0") == 1
    assert block_chain(tokens, B, "tenant-a")[0] == hash_block(salt_root("tenant-a"), tokens[:B])


def test_precise_kv_routes_a_real_engines_salted_blocks_to_the_same_salt_only() -> None:
    """The engine's KV manager hashes a salted request and the router keys its events and the next
    request: the same salt finds the blocks, another does not."""
    engine = EngineCore(FakeRunner(), KVCacheManager(32, B, enable_kv_cache_events=True),
                        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512),
                        eos_token_ids=[0])
    tokens = prompt(1, 4)
    engine.add_request(EngineRequest("a", tokens, SamplingParams(max_tokens=2), cache_salt="tenant-a"))
    policy = PreciseKV()
    while engine.has_unfinished_requests():
        engine.step()
        policy.on_kv_events("r1", engine.take_kv_events())
    assert policy.choose(RouteRequest("q", token_ids=tokens, cache_salt="tenant-a"), replicas(0, 0)) == \
        RouteDecision("r1", "prefix", 4 * B)
    assert policy.choose(RouteRequest("q", token_ids=tokens, cache_salt="tenant-b"), replicas(0, 0)).reason == \
        "no_prefix"


def test_approximate_prefix_keeps_salts_apart() -> None:
    policy = make_policy("prefix")
    tokens = prompt(1, 6)
    route(policy, RouteRequest("a", token_ids=tokens, cache_salt="alice"), replicas(0, 0))
    home = policy.choose(RouteRequest("a2", token_ids=tokens, cache_salt="alice"), replicas(0, 0))
    assert home.reason == "prefix" and home.predicted_hit_tokens == 6 * B
    bob = RouteRequest("b", token_ids=tokens, cache_salt="bob")
    assert policy.choose(bob, replicas(0, 0)).predicted_hit_tokens == 0


@pytest.mark.parametrize("name", ["prefix", "kv_events"])
def test_a_removed_replicas_blocks_never_show_up_on_a_newcomer(name: str) -> None:
    """Replicas are bits in a mask and a removed one's bit is reused: the newcomer starts empty."""
    policy = make_policy(name)
    tokens = prompt(1, 6)
    if name == "prefix":
        route(policy, RouteRequest("a", token_ids=tokens), replicas(0))
        route(policy, RouteRequest("b", token_ids=prompt(2, 6)), [ReplicaState("r1", num_running=1)])
    else:
        policy.on_kv_events("r0", [stored(tokens, None, [1, 2, 3, 4, 5, 6])])
        policy.on_kv_events("r1", [stored(prompt(2, 6), None, [7, 8, 9, 10, 11, 12])])
    policy.remove_replica("r0")
    states = [ReplicaState("r1", num_running=1), ReplicaState("new")]
    assert policy.choose(RouteRequest("c", token_ids=tokens), states).predicted_hit_tokens == 0
    assert policy.choose(RouteRequest("d", token_ids=prompt(2, 6)), states) == RouteDecision("r1", "prefix", 6 * B)


def test_precise_kv_spreads_new_prefixes_over_idle_replicas() -> None:
    policy = PreciseKV()
    homes = []
    for g in range(3):
        tokens = prompt(g, 4)
        decision = policy.choose(RouteRequest(f"q{g}", token_ids=tokens), replicas(0, 0, 0))
        assert decision.reason == "no_prefix"
        homes.append(decision.replica)
        policy.on_kv_events(decision.replica, [stored(tokens, None, [10 * g + i for i in range(4)])])
    assert homes == ["r0", "r1", "r2"]


def test_precise_kv_compares_replicas_with_different_block_sizes_in_tokens() -> None:
    """A vLLM-CPU replica (128-token blocks) beside a tokenline one (16): a 300-token prompt is 2
    blocks there and 18 here, which as a block count made vLLM look 9x cheaper, so it took every
    new prompt even while busy (seen with a real vLLM behind the router)."""
    policy = PreciseKV()
    vllm, tokenline = ReplicaState("vllm", block_size=128), ReplicaState("tokenline", block_size=16)
    tokens = prompt(1, 19)[:300]
    busy_vllm = ReplicaState("vllm", block_size=128, in_flight=1)
    assert policy.choose(RouteRequest("q0", token_ids=tokens), [busy_vllm, tokenline]).replica == "tokenline"
    # Idle and empty: a tie in tokens, broken by name; vLLM holding the prompt's two blocks wins it.
    assert policy.choose(RouteRequest("q1", token_ids=tokens), [vllm, tokenline]) == RouteDecision(
        "tokenline", "no_prefix")
    policy.on_kv_events("vllm", [BlockStored([1, 2], None, tokens[:256], 128)])
    assert policy.choose(RouteRequest("q2", token_ids=tokens), [vllm, tokenline]) == RouteDecision(
        "vllm", "prefix", 256)


def test_precise_kv_groups_and_typical_blocks() -> None:
    # Each group's prefix stored on one replica: every group member follows it.
    policy = PreciseKV()
    groups = [prompt(g, 8) for g in range(3)]
    for g, tokens in enumerate(groups):
        policy.on_kv_events(f"r{g}", [stored(tokens, None, [100 * g + i for i in range(8)])])
    for i in range(12):
        decision = policy.choose(RouteRequest(f"q{i}", token_ids=groups[i % 3] + prompt(50 + i, 2)), replicas(1, 1, 1))
        assert decision == RouteDecision(f"r{i % 3}", "prefix", 8 * B)
    # With a small typical_blocks the cache dominates load.
    sticky = PreciseKV(typical_blocks=1)
    sticky.on_kv_events("r0", [stored(groups[0], None, list(range(8)))])
    assert sticky.choose(RouteRequest("q", token_ids=groups[0]), replicas(7, 0)).replica == "r0"


# --- session affinity ---------------------------------------------------------------------------


def test_session_affinity_sticks_and_falls_back_when_the_replica_is_gone() -> None:
    policy = SessionAffinity(RoundRobin(), max_sessions=2)
    states = replicas(0, 0, 0)
    assert route(policy, RouteRequest("1", session="alice"), states) == RouteDecision("r0", "round_robin")
    assert route(policy, RouteRequest("2", session="bob"), states).replica == "r1"
    assert route(policy, RouteRequest("3", session="alice"), states) == RouteDecision("r0", "session")
    assert route(policy, RouteRequest("4"), states).replica == "r2"  # no session: the inner policy
    # r0 is gone: alice moves (the inner policy decides) and stays on her new replica.
    moved = route(policy, RouteRequest("5", session="alice"), states[1:])
    assert moved.reason == "round_robin" and moved.replica != "r0"
    assert route(policy, RouteRequest("6", session="alice"), states) == RouteDecision(moved.replica, "session")
    # LRU of two sessions: carol pushes out bob (alice was used last).
    route(policy, RouteRequest("7", session="carol"), states)
    assert policy.choose(RouteRequest("8", session="bob"), states).reason == "round_robin"
    assert policy.choose(RouteRequest("9", session="alice"), states).reason == "session"
    assert policy.name == "round_robin+session"


def test_session_affinity_passes_events_to_the_inner_policy() -> None:
    inner = PreciseKV()
    policy = SessionAffinity(inner)
    tokens = prompt(1, 4)
    policy.on_kv_events("r1", [stored(tokens, None, [1, 2, 3, 4])])
    assert policy.choose(RouteRequest("q", token_ids=tokens, session="s"), replicas(0, 0)).replica == "r1"
    policy.remove_replica("r1")
    assert inner.cached_blocks("r1") == 0


# --- vLLM's own bytes ---------------------------------------------------------------------------


def vllm_fixture() -> dict:
    return json.loads((FIXTURES / "vllm_events.json").read_text())


def test_decode_reads_vllm_0_32_batches() -> None:
    facts = vllm_fixture()
    batch = decode_event_batch((FIXTURES / "vllm_stored.msgpack").read_bytes())
    assert batch.data_parallel_rank == 0 and batch.ts == 1764558000.25
    first, second = batch.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == facts["block_hashes"][:4] and first.parent_block_hash is None
    assert second.block_hashes == facts["block_hashes"][4:] and second.parent_block_hash == facts["block_hashes"][3]
    assert first.token_ids + second.token_ids == facts["prompt"]
    assert (first.block_size, first.lora_id, first.medium) == (16, None, "GPU")
    assert all(isinstance(h, int) and h >= 2**32 for h in first.block_hashes)  # 64-bit ints
    removed = decode_event_batch((FIXTURES / "vllm_removed.msgpack").read_bytes()).events
    assert removed == [BlockRemoved(facts["block_hashes"][4:], "GPU")]
    assert decode_event_batch((FIXTURES / "vllm_cleared.msgpack").read_bytes()).events == [AllBlocksCleared()]


def test_precise_kv_fed_vllm_events_routes_their_tokens_there() -> None:
    facts = vllm_fixture()
    tokens = facts["prompt"]
    policy = PreciseKV()
    policy.on_kv_events("vllm-1", decode_event_batch((FIXTURES / "vllm_stored.msgpack").read_bytes()).events)
    states = [ReplicaState("vllm-0"), ReplicaState("vllm-1"), ReplicaState("vllm-2")]
    assert policy.choose(RouteRequest("q", token_ids=tokens + [1, 2]), states) == \
        RouteDecision("vllm-1", "prefix", 6 * B)
    policy.on_kv_events("vllm-1", decode_event_batch((FIXTURES / "vllm_removed.msgpack").read_bytes()).events)
    assert policy.choose(RouteRequest("q", token_ids=tokens), states).predicted_hit_tokens == 4 * B
    policy.on_kv_events("vllm-1", decode_event_batch((FIXTURES / "vllm_cleared.msgpack").read_bytes()).events)
    assert policy.choose(RouteRequest("q", token_ids=tokens), states) == RouteDecision("vllm-0", "no_prefix")


def test_vllm_frames_over_real_zmq_reach_the_policy() -> None:
    """A PUB socket sending vLLM's frames (topic, 8-byte big-endian seq, payload) to our
    subscriber, whose batches feed the policy."""
    facts = vllm_fixture()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    payloads = [(FIXTURES / f"vllm_{n}.msgpack").read_bytes() for n in ("stored", "removed", "cleared")]
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    subscriber = KVEventSubscriber(endpoint, topic="kv")
    policy = PreciseKV()
    states = [ReplicaState("a"), ReplicaState("b")]
    request = RouteRequest("q", token_ids=facts["prompt"])
    stop = threading.Event()
    sent: list[int] = []

    def publish() -> None:
        # PUB drops messages until the subscription arrives: resend the first batch (same seq,
        # which the subscriber skips once seen) until the test has seen it.
        while not stop.is_set() and not sent:
            pub.send_multipart((b"kv", (0).to_bytes(8, "big"), payloads[0]))
            time.sleep(0.02)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        got = subscriber.receive(timeout_ms=5000)
        sent.append(1)
        thread.join(5)
        assert [seq for seq, _ in got] == [0]
        policy.on_kv_events("b", got[0][1].events)
        assert policy.choose(request, states) == RouteDecision("b", "prefix", 6 * B)
        for seq, payload in enumerate(payloads[1:], start=1):
            pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))
            got = []
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                got = subscriber.receive(timeout_ms=500)  # resent seq 0 copies are skipped
            assert [s for s, _ in got] == [seq]
            policy.on_kv_events("b", got[0][1].events)
            expected = 4 * B if seq == 1 else 0
            assert policy.choose(request, states).predicted_hit_tokens == expected
        assert policy.choose(request, states) == RouteDecision("a", "no_prefix")
    finally:
        stop.set()
        thread.join(5)
        subscriber.close()
        pub.close(linger=0)


def test_block_chain_matches_the_engine_keys() -> None:
    tokens = list(range(3 * B + 5))
    chain = block_chain(tokens, B)
    assert len(chain) == 3
    assert chain[1] == hash_block(hash_block(None, tokens[:B]), tokens[B : 2 * B])
