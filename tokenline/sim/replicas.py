"""``tokenline simulate --replicas N --routing-policy NAME``: N simulated engines on one simulated
clock behind a routing policy — the fleet's own ``RoutingPolicy`` objects (``router/policies.py``),
told about every routed and finished request and fed each engine's KV events, as ``FleetClient``
feeds them.

A discrete-event loop: each replica is the real ``EngineCore`` (``build_sim_core``) on its own
``SimClock``. An idle replica with work starts a step at the current time; the step runs at once
but its outputs, KV events and load are delivered when the predicted step time has passed, so the
policy sees each replica as a router would (its last reported load plus the requests in flight).
Events at equal times go completions first, then arrivals, then new steps.

The client is ``bench serve``'s closed loop: at most ``concurrency`` conversations at a time, each
turn sent when the previous one finished. The random workload is one-turn conversations; the
multi-turn one is ``bench/multiturn.py``'s (groups sharing a system prompt, the placeholder answers
fed back), rendered with the model's chat template, so routing decides prefix hits.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from tokenline.bench.multiturn import MultiturnWorkload, make_multiturn_workload
from tokenline.bench.prompts import load_tokenizer, make_prompts, ordinary_token_ids
from tokenline.bench.results import BenchServeReport, RequestResult, cached_share
from tokenline.engine.engine_core import EngineCore
from tokenline.engine.kv_events import KVCacheEvent
from tokenline.engine.messages import EngineOutput, EngineRequest, EngineStats
from tokenline.router.data_parallel import DEFAULT_DATA_PARALLEL_POLICY, build_policy
from tokenline.router.policy import (
    ReplicaState,
    RouteDecision,
    RouteRequest,
    RoutingPolicy,
)
from tokenline.sampling_params import SamplingParams
from tokenline.sim.placeholder_runner import SimClock
from tokenline.sim.profile import Profile
from tokenline.sim.sim_target import SimTarget
from tokenline.sim.simulate import (
    ClosedLoopRun,
    SimConfig,
    build_sim_core,
    report,
    request_overhead,
    sim_target,
)

WORKLOADS = ("random", "multiturn")


class Conversations(Protocol):
    """What the closed loop sends: conversations of one or more turns; a turn's prompt may depend
    on the answers (output token ids) of the earlier turns."""

    def __len__(self) -> int: ...

    def turns(self, conversation: int) -> int: ...

    def prompt(self, conversation: int, turn: int, answers: Sequence[list[int]]) -> list[int]: ...

    def session(self, conversation: int) -> str | None: ...


@dataclass
class SinglePrompts:
    """The random workload: one-turn conversations."""

    prompts: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompts)

    def turns(self, conversation: int) -> int:
        return 1

    def prompt(self, conversation: int, turn: int, answers: Sequence[list[int]]) -> list[int]:
        return self.prompts[conversation]

    def session(self, conversation: int) -> str | None:
        return None


class ChatTokenizer(Protocol):
    vocab_size: int

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def render_chat(self, messages: Sequence[dict[str, str]]) -> Any: ...

    def encode_chat(self, rendered: Any) -> list[int]: ...


@dataclass
class ChatConversations:
    """``bench serve --workload multiturn``'s conversations as token ids: each turn's chat rendered
    with the chat template as the server would, the earlier answers decoded and fed back."""

    workload: MultiturnWorkload
    tokenizer: ChatTokenizer

    def __len__(self) -> int:
        return len(self.workload.conversations)

    def turns(self, conversation: int) -> int:
        return len(self.workload.conversations[conversation].user_messages)

    def prompt(self, conversation: int, turn: int, answers: Sequence[list[int]]) -> list[int]:
        vocab = self.tokenizer.vocab_size  # a what-if model's placeholders may lie past this tokenizer's ids
        texts = [self.tokenizer.decode([i for i in a if i < vocab]) for a in answers[:turn]]
        messages = self.workload.messages(self.workload.conversations[conversation], texts)
        return self.tokenizer.encode_chat(self.tokenizer.render_chat(messages))

    def session(self, conversation: int) -> str | None:
        return self.workload.conversations[conversation].conversation_id  # bench serve sends it as `user`

    def filler_token_id(self, answer_len: int) -> int | None:
        """A token whose ``answer_len`` repeats, fed back as an answer, render as the same ids after
        the first turn's prompt (``PlaceholderRunner.filler_token_id``); None if no candidate does."""
        if not self.workload.conversations or self.turns(0) < 2:
            return None
        first = self.prompt(0, 0, [])
        for text in (" the", " a", "the"):
            ids = self.tokenizer.encode_chat(text)
            if len(ids) != 1:
                continue
            answer = ids * answer_len
            if self.prompt(0, 1, [answer])[: len(first) + answer_len] == first + answer:
                return ids[0]
        return None


@dataclass
class ReplicaCounters:
    """One simulated replica over the run: what the router sent and what the engine reported."""

    name: str
    requests: int = 0
    decisions: dict[str, int] = field(default_factory=dict)  # routing reason -> requests
    predicted_hit_tokens: int = 0  # prompt tokens the policy expected cached there
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine reported cached (usage's cached_tokens)
    output_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0  # the engine's counters, as vllm:prefix_cache_queries / _hits
    prefix_cache_hits: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


@dataclass
class FleetRun:
    run: ClosedLoopRun
    turns: list[int]  # the turn index of each result
    replicas: list[ReplicaCounters]


@dataclass
class _InFlight:
    index: int  # into the results
    conversation: int
    turn: int
    prompt: list[int]
    sent: float
    replica: str = ""
    last: float = 0.0
    output: list[int] = field(default_factory=list)


_DONE, _ARRIVE = 0, 1  # at equal times a finished step is delivered before an arrival is routed


def run_fleet_closed_loop(
    cores: dict[str, EngineCore],
    clocks: dict[str, SimClock],
    policy: RoutingPolicy,
    conversations: Conversations,
    output_len: int,
    concurrency: int,
    request_overhead_s: float = 0.0,
    block_size: int = 16,
) -> FleetRun:
    """Run ``conversations`` through ``cores`` (each on its own clock in ``clocks``) behind
    ``policy``, at most ``concurrency`` conversations at a time. A request reaches the router
    ``request_overhead_s`` after its client sends it, one at a time (as ``run_closed_loop``'s);
    TTFT and E2E count from the send."""
    names = list(cores)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True).with_defaults()
    order = itertools.count()  # ties in time keep their order: the run is deterministic
    events: list[tuple[float, int, int, Any]] = []
    results: list[RequestResult] = []
    turns: list[int] = []
    flights: dict[str, _InFlight] = {}
    answers: dict[int, list[list[int]]] = {}
    stats = {name: cores[name].stats() for name in names}
    busy = dict.fromkeys(names, False)
    in_flight: Counter[str] = Counter()
    counters = {name: ReplicaCounters(name) for name in names}
    reasons: dict[str, Counter[str]] = {name: Counter() for name in names}
    next_conversation = 0
    requests_in_flight = max_in_flight = 0
    api_free_at = 0.0  # the router's API process takes requests in turn, as simulate's single server does

    def send_turn(conversation: int, turn: int, now: float) -> None:
        nonlocal requests_in_flight, max_in_flight, api_free_at
        prompt = conversations.prompt(conversation, turn, answers[conversation])
        flight = _InFlight(len(results), conversation, turn, prompt, now)
        results.append(RequestResult(prompt_len=len(prompt)))
        turns.append(turn)
        flights[str(flight.index)] = flight
        requests_in_flight += 1
        max_in_flight = max(max_in_flight, requests_in_flight)
        api_free_at = max(now, api_free_at) + request_overhead_s
        heapq.heappush(events, (api_free_at, _ARRIVE, next(order), str(flight.index)))

    def start_conversation(now: float) -> None:
        nonlocal next_conversation
        if next_conversation < len(conversations):
            answers[next_conversation] = []
            send_turn(next_conversation, 0, now)
            next_conversation += 1

    def route(request_id: str, now: float) -> None:
        flight = flights[request_id]
        request = RouteRequest(request_id, token_ids=flight.prompt, session=conversations.session(flight.conversation))
        if len(names) == 1:
            decision = RouteDecision(names[0], "only_replica")
        else:
            states = [ReplicaState(name=n, num_running=stats[n].num_running, num_waiting=stats[n].num_waiting,
                                   kv_cache_usage=stats[n].kv_cache_usage, in_flight=in_flight[n],
                                   block_size=block_size, num_kv_blocks=stats[n].num_kv_blocks) for n in names]
            decision = policy.choose(request, states)
        policy.on_routed(request, decision)
        name = flight.replica = decision.replica
        in_flight[name] += 1
        counters[name].requests += 1
        counters[name].predicted_hit_tokens += decision.predicted_hit_tokens
        reasons[name][decision.reason] += 1
        cores[name].add_request(EngineRequest(request_id, flight.prompt, params, arrival_time=now))

    def deliver(name: str, outputs: list[EngineOutput], kv_events: list[KVCacheEvent], step_stats: EngineStats,
                now: float) -> None:
        nonlocal requests_in_flight
        busy[name] = False
        stats[name] = step_stats
        if kv_events:
            policy.on_kv_events(name, kv_events)
        for out in outputs:
            flight = flights[out.request_id]
            result = results[flight.index]
            if out.new_token_ids:
                if result.ttft is None:
                    result.ttft = now - flight.sent
                else:
                    result.itl.append(now - flight.last)
                flight.last = now
                flight.output.extend(out.new_token_ids)
            if not out.finished:
                continue
            result.e2e = now - flight.sent
            result.output_tokens = out.num_output_tokens
            result.cached_tokens = out.num_cached_tokens
            result.usage_reported = result.success = True
            c = counters[name]
            c.prompt_tokens += out.num_prompt_tokens
            c.cached_tokens += out.num_cached_tokens
            c.output_tokens += out.num_output_tokens
            del flights[out.request_id]
            in_flight[name] -= 1
            requests_in_flight -= 1
            policy.on_finished(out.request_id, name)
            answers[flight.conversation].append(flight.output)
            if flight.turn + 1 < conversations.turns(flight.conversation):
                send_turn(flight.conversation, flight.turn + 1, now)
            else:
                start_conversation(now)

    for _ in range(min(concurrency, len(conversations))):
        start_conversation(0.0)
    now = 0.0
    while events:
        now, kind, _, payload = heapq.heappop(events)
        if kind == _DONE:
            deliver(*payload, now)
        else:
            route(payload, now)
        if events and events[0][0] <= now:
            continue  # everything due now first, then the idle replicas start their steps
        for name in names:
            core = cores[name]
            if busy[name] or not core.has_unfinished_requests():
                continue
            clocks[name].wait_until(now)
            outputs = core.step()
            if not core.take_step_records():
                continue  # nothing could be scheduled: it waits for the next event
            busy[name] = True
            done = (name, outputs, core.take_kv_events(), core.stats())
            heapq.heappush(events, (clocks[name](), _DONE, next(order), done))
    if flights:
        raise RuntimeError(f"{len(flights)} request(s) could never be scheduled (KV pool too small?)")
    for name, c in counters.items():
        core = cores[name]
        c.decisions = dict(reasons[name])
        c.steps = core.num_steps
        c.preemptions = core.scheduler.num_preemptions
        c.prefix_cache_queries = core.kv_cache.prefix_stats.queries
        c.prefix_cache_hits = core.kv_cache.prefix_stats.hits
    return FleetRun(ClosedLoopRun(results, now, max_in_flight), turns, list(counters.values()))


def add_fleet_results(report: BenchServeReport, fleet: FleetRun) -> None:
    """Fill ``bench serve``'s prefix-cache fields from the replicas' own counters (the fleet rate is
    hits over queries summed over replicas, as bench serve sums each replica's /metrics) and the
    usage-side cached share, per turn for multi-turn runs."""
    queries = sum(c.prefix_cache_queries for c in fleet.replicas)
    hits = sum(c.prefix_cache_hits for c in fleet.replicas)
    report.prefix_cache_queries = float(queries)
    report.prefix_cache_hits = float(hits)
    report.prefix_cache_hit_rate = hits / queries if queries else None
    report.prefix_cache_replicas = [
        {"url": c.name, "engine": "", "queries": c.prefix_cache_queries, "hits": c.prefix_cache_hits,
         "hit_rate": c.hit_rate, **{k: v for k, v in asdict(c).items() if not k.startswith("prefix_cache") and k != "name"}}
        for c in fleet.replicas
    ]
    ok = [(r, t) for r, t in zip(fleet.run.results, fleet.turns) if r.success]
    report.cached_prompt_tokens, report.cached_tokens_share = cached_share([r for r, _ in ok])
    if max(fleet.turns, default=0) > 0:
        report.cached_tokens_share_by_turn = [
            cached_share([r for r, t in ok if t == turn])[1] for turn in range(max(fleet.turns) + 1)]


@dataclass
class FleetConfig:
    """The fleet and the workload of ``simulate --replicas``; the engines' settings are ``SimConfig``'s."""

    replicas: int = 2
    routing_policy: str = DEFAULT_DATA_PARALLEL_POLICY
    session_affinity: bool = False
    # bench serve's workloads: "random" (SimConfig's prompts, optionally sharing a prefix) or
    # "multiturn" (num_conversations chats of `turns` turns over num_groups system prompts).
    workload: str = "random"
    shared_prefix_len: int = 0
    num_groups: int = 4
    num_conversations: int = 16
    turns: int = 4
    system_prompt_len: int = 512
    tokenizer_dir: str | None = None  # the multiturn chats' tokenizer and template (default: the default model's)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {list(WORKLOADS)}, not {self.workload!r}")
        if min(self.num_groups, self.num_conversations, self.turns, self.system_prompt_len) < 1:
            raise ValueError("num_groups, num_conversations, turns and system_prompt_len must be >= 1")
        if self.shared_prefix_len < 0:
            raise ValueError("shared_prefix_len must be >= 0")
        if self.shared_prefix_len and self.workload != "random":
            raise ValueError("--shared-prefix-len is the random workload's (multiturn shares system prompts)")


def fleet_conversations(config: SimConfig, fleet: FleetConfig, vocab_size: int) -> Conversations:
    if fleet.workload == "random":
        if fleet.shared_prefix_len > config.input_len:
            raise ValueError("shared_prefix_len must be between 0 and input_len")
        # Seeded like bench serve's and simulate's own prompts (the same ones without a shared prefix).
        return SinglePrompts(make_prompts(config.num_prompts, config.input_len, range(vocab_size), config.seed,
                                          fleet.shared_prefix_len))
    tokenizer = load_tokenizer(fleet.tokenizer_dir)
    workload = make_multiturn_workload(
        num_groups=fleet.num_groups, num_conversations=fleet.num_conversations, turns=fleet.turns,
        system_prompt_len=fleet.system_prompt_len, input_len=config.input_len,
        ordinary_ids=ordinary_token_ids(tokenizer.vocab_size, tokenizer.all_special_ids),
        decode=tokenizer.decode, seed=config.seed,
    )
    return ChatConversations(workload, tokenizer)


def simulate_replicas(profile: Profile, config: SimConfig, fleet: FleetConfig,
                      target: SimTarget | None = None) -> BenchServeReport:
    """``fleet.replicas`` engines like ``simulate``'s behind ``fleet.routing_policy``, reported as
    ``bench serve`` reports a fleet: its fields, the fleet prefix hit rate and one entry per replica."""
    target = target or sim_target(profile, config)
    policy = build_policy(fleet.routing_policy, fleet.session_affinity, config.seed)
    clocks = {f"replica-{i}": SimClock() for i in range(fleet.replicas)}
    conversations = fleet_conversations(config, fleet, target.vocab_size)
    filler = conversations.filler_token_id(config.output_len) if isinstance(conversations, ChatConversations) else None
    cores = {name: build_sim_core(target, config, clock, kv_events=True, filler_token_id=filler)
             for name, clock in clocks.items()}
    overhead = request_overhead(profile, config, target)
    run = run_fleet_closed_loop(cores, clocks, policy, conversations, config.output_len, config.concurrency,
                                overhead, config.block_size)
    result = report(run.run, config, target.model, f"simulated: {fleet.replicas} x {policy.name}")
    result.num_prompts = len(run.run.results)
    result.shared_prefix_len = fleet.shared_prefix_len
    result.workload = fleet.workload
    if fleet.workload == "multiturn":
        result.endpoint, result.input_len_exact = "chat", False  # chat text, as bench serve's
        result.num_groups, result.num_conversations = fleet.num_groups, fleet.num_conversations
        result.turns, result.system_prompt_len = fleet.turns, fleet.system_prompt_len
    add_fleet_results(result, run)
    return result


def format_replicas(result: BenchServeReport) -> str:
    """One line per replica: requests and why they went there, prefix hits, steps, preemptions."""
    lines = []
    for r in result.prefix_cache_replicas:
        why = ", ".join(f"{reason} {n}" for reason, n in sorted(r["decisions"].items()))
        rate = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        lines.append(f"{r['url']}: {r['requests']} requests ({why or 'none'}), {r['cached_tokens']}/"
                     f"{r['prompt_tokens']} prompt tokens cached ({rate} of queries; policy predicted "
                     f"{r['predicted_hit_tokens']}), {r['output_tokens']} output tokens, {r['steps']} steps, "
                     f"{r['preemptions']} preemptions")
    return "\n".join(lines)
