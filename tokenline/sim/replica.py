"""``tokenline serve --simulate PROFILE``: a replica whose engine process runs the real
``EngineCore``, ``Scheduler`` and ``KVCacheManager`` with the placeholder runner instead of a model.

Each step sleeps the profile's predicted step time on the wall clock (``speed`` times faster) and
emits placeholder tokens: ordinary tokens of the served model's tokenizer, never a special token
or EOS, so the API's detokenizer and usage work and ``max_tokens`` decides the length. The server
around it is the real one (gateway, /metrics, /v1/events, KV events), so routers and dashboards
can be tried on dozens of replicas on one small machine: no torch, no weights, an idle replica
blocks on its pipe.
"""

from __future__ import annotations

import dataclasses
import json
import string
import time
from dataclasses import dataclass
from pathlib import Path

from tokenline.engine.config import GIB, EngineConfig
from tokenline.engine.engine_core import EngineCore, RequestRejected
from tokenline.engine.kv_cache_manager import KVCacheManager
from tokenline.engine.messages import EngineRequest
from tokenline.engine.scheduler import SchedulerConfig
from tokenline.model.batch import SampledToken, ScheduledBatch, TokenLogprobs
from tokenline.model.config import ModelConfig
from tokenline.model.kv_groups import group_windows, kv_block_bytes
from tokenline.sim.placeholder_runner import PlaceholderRunner, SimClock
from tokenline.sim.profile import Profile


class WallClock(SimClock):
    """``time.monotonic`` (the API process stamps arrivals on the same clock); advancing it sleeps
    ``seconds / speed``."""

    def __init__(self, speed: float = 1.0) -> None:
        super().__init__()
        self.speed = speed

    def __call__(self) -> float:
        return time.monotonic()

    def advance(self, seconds: float) -> None:
        time.sleep(seconds / self.speed)

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))


class ReplicaRunner(PlaceholderRunner):
    """The placeholder runner with what a served engine reports: a dtype, and a logprob of 0 (the
    placeholder is certain) for requests that ask for logprobs."""

    def __init__(self, clock: SimClock, profile: Profile, vocab_size: int, avoid_token_ids: frozenset[int]) -> None:
        super().__init__(clock, profile.step_model, vocab_size, avoid_token_ids)
        self.dtype = profile.dtype

    def execute(self, batch: ScheduledBatch) -> dict[str, SampledToken]:
        sampled = super().execute(batch)
        for seq in batch.seqs:
            token = sampled.get(seq.request_id)
            if token is not None and seq.sampling.logprobs is not None:
                token.logprobs = TokenLogprobs(0.0, [(token.token_id, 0.0)] if seq.sampling.logprobs else [])
        return sampled


class SimulatedEngineCore(EngineCore):
    """The real engine loop; only what placeholder tokens cannot honour is refused or dropped."""

    def add_request(self, engine_request: EngineRequest) -> None:
        sampling = engine_request.sampling
        if sampling.structured_outputs is not None:
            raise RequestRejected("structured_outputs", "a simulated replica (serve --simulate) emits placeholder "
                                                        "tokens and cannot follow a grammar")
        if sampling.seed is not None:
            # Placeholder tokens ignore the seed; dropping it keeps torch (the seeded RNG) out of this process.
            engine_request = dataclasses.replace(engine_request, sampling=dataclasses.replace(sampling, seed=None))
        super().add_request(engine_request)


_READABLE = frozenset(string.ascii_letters + string.digits + string.punctuation + "Ġ")  # Ġ: byte-level space


def placeholder_avoid_ids(tokenizer_dir: Path, vocab_size: int) -> frozenset[int]:
    """Ids a placeholder must never be: the special ones of ``tokenizer.json`` and, for a byte-level
    BPE vocabulary, every token that is not plain ASCII words and punctuation (so the text reads as
    words, never control characters or half a UTF-8 character)."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return frozenset()
    raw = json.loads(path.read_text())
    special = {int(t["id"]) for t in raw.get("added_tokens") or [] if t.get("special")}
    model = raw.get("model") or {}
    vocab = model.get("vocab") if model.get("type") == "BPE" else None
    if not isinstance(vocab, dict):
        return frozenset(special)
    readable = {int(i) for text, i in vocab.items() if len(text) > 1 and set(text) <= _READABLE} - special
    if len(readable) < 256:  # not a byte-level vocabulary after all: avoid only the special ids
        return frozenset(special)
    return frozenset(i for i in range(vocab_size) if i not in readable)


def num_kv_blocks(profile: Profile, config: EngineConfig, model_config: ModelConfig) -> int:
    """``config.num_kv_blocks``, else the blocks the profile's model fits in ``kv_cache_memory_gib``."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    return int(config.kv_cache_memory_gib * GIB) // kv_block_bytes(model_config, profile.kv_bytes_per_token,
                                                                    config.block_size)


@dataclass(frozen=True)
class SimulatedReplica:
    """``EngineConfig.core_factory`` of a simulated replica (picklable: it travels to the spawned
    engine process with the config)."""

    profile: Profile
    speed: float = 1.0  # wall-clock seconds run this many times faster than the profile predicts

    def __post_init__(self) -> None:
        if not self.speed > 0:
            raise ValueError(f"--simulate-speed must be positive, got {self.speed}")

    def __call__(self, config: EngineConfig, model_dir: Path, vocab_size: int | None) -> EngineCore:
        model_config = ModelConfig.from_dir(model_dir)
        max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                            model_config.max_position_embeddings)
        eos = frozenset(model_config.eos_token_ids)
        vocab_size = vocab_size or self.profile.vocab_size
        avoid = placeholder_avoid_ids(Path(config.tokenizer or model_dir), vocab_size) | eos
        clock = WallClock(self.speed)
        runner = ReplicaRunner(clock, self.profile, vocab_size, avoid)
        num_blocks = num_kv_blocks(self.profile, config, model_config)
        block_bytes = kv_block_bytes(model_config, self.profile.kv_bytes_per_token, config.block_size)
        kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, 0, config.kv_cache_events,
                                  cache_resident_blocks=config.cache_resident_blocks(num_blocks, block_bytes),
                                  group_windows=group_windows(model_config),
                                  max_chunk_tokens=config.max_num_batched_tokens)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        return SimulatedEngineCore(runner, kv_cache, scheduler_config, eos_token_ids=eos, clock=clock)
