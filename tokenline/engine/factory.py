"""The one place that assembles an engine from its settings: the model, the KV pool sized from the
memory budget, the scheduler, the speculative proposer and the grammar compiler."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tokenline.engine.config import GIB, EngineConfig

if TYPE_CHECKING:
    from tokenline.engine.engine_core import EngineCore


def hybrid_checkpoint_count(config: EngineConfig, state_bytes: int) -> int:
    """State checkpoint slots for a hybrid model: as configured, else 2 per sequence slot but at
    most half of the cache memory (0 when prefix caching is off)."""
    if not config.enable_prefix_caching:
        return 0
    if config.hybrid_state_checkpoints is not None:
        return config.hybrid_state_checkpoints
    half = int(config.kv_cache_memory_gib * GIB) // 2 // max(1, state_bytes)
    return max(1, min(2 * config.max_num_seqs, half))


def build_engine_core(config: EngineConfig, model_dir: Path, vocab_size: int | None = None) -> EngineCore:
    """Load the model, size the KV pool from the memory budget and wire scheduler and runner."""
    if config.core_factory is not None:
        config.validate()
        return config.core_factory(config, model_dir, vocab_size)
    # Imported here so that the API process, which only needs EngineConfig, never loads torch.
    from tokenline.engine.engine_core import EngineCore
    from tokenline.engine.kv_cache_manager import KVCacheManager
    from tokenline.engine.scheduler import SchedulerConfig
    from tokenline.model.config import ModelConfig
    from tokenline.model.loader import resolve_dtype
    from tokenline.model.runner import ModelRunner
    from tokenline.spec_decode.mtp_proposer import MtpProposer
    from tokenline.spec_decode.ngram_proposer import NgramProposer
    from tokenline.spec_decode.suffix_proposer import SuffixProposer
    from tokenline.structured_output.grammar import GrammarCompiler

    config.validate()
    if config.seed is not None:
        import torch

        torch.manual_seed(config.seed)  # the default RNG draws the noise of unseeded requests
    model_config = ModelConfig.from_dir(model_dir)
    max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                        model_config.max_position_embeddings)
    dtype = resolve_dtype(config.dtype, config.device)
    mtp_tokens = config.num_speculative_tokens if config.speculative == "mtp" else 0
    kv_dtype = None if config.kv_cache_dtype == "auto" else resolve_dtype(config.kv_cache_dtype, config.device)
    runner = ModelRunner(model_dir, dtype, config.device, max_model_len, vocab_size, model_config, mtp_tokens,
                         config.quantization, kv_dtype)
    # Hybrid models hold one fixed-size recurrent state per running sequence: reserve those slots
    # out of the same memory budget first, the rest goes to KV blocks.
    num_state_slots = config.max_num_seqs if model_config.is_hybrid else 0
    num_checkpoints = hybrid_checkpoint_count(config, runner.state_bytes_per_sequence()) if num_state_slots else 0
    state_bytes = (num_state_slots + num_checkpoints) * runner.state_bytes_per_sequence()
    budget = int(config.kv_cache_memory_gib * GIB) - state_bytes
    num_blocks = config.num_kv_blocks or max(0, budget) // runner.kv_bytes_per_block(config.block_size)
    if not num_blocks and num_state_slots:
        # A realistic hybrid's states are large (Qwen3.5-0.8B: 18 MiB a sequence): say what took the budget.
        raise ValueError(
            f"--kv-cache-memory {config.kv_cache_memory_gib:g} GiB leaves no KV cache block after this hybrid "
            f"model's recurrent states: {num_state_slots} sequence slots (--max-num-seqs) and {num_checkpoints} "
            f"prefix-cache checkpoints (--hybrid-state-checkpoints) of "
            f"{runner.state_bytes_per_sequence() / 2**20:.1f} MiB each take {state_bytes / GIB:.2f} GiB; raise "
            "--kv-cache-memory or lower --max-num-seqs")
    runner.allocate_kv_cache(num_blocks, config.block_size, num_state_slots + num_checkpoints)
    kv_cache = KVCacheManager(
        num_blocks, config.block_size, config.enable_prefix_caching, num_state_slots, config.kv_cache_events,
        num_checkpoints=num_checkpoints,
        checkpoint_interval=config.hybrid_state_checkpoint_interval or 4 * config.block_size,
        cache_resident_blocks=config.cache_resident_blocks(num_blocks, runner.kv_bytes_per_block(config.block_size)),
        group_windows=runner.kv_group_windows,
        max_chunk_tokens=config.max_num_batched_tokens,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        fused_step_tokens=runner.model.fused_step_tokens(),
    )
    proposer: NgramProposer | SuffixProposer | MtpProposer | None = None
    if config.speculative == "ngram":
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    elif config.speculative == "suffix":
        proposer = SuffixProposer(
            config.num_speculative_tokens, config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob,
        )
    elif config.speculative == "mtp":
        proposer = MtpProposer(config.num_speculative_tokens)  # hands on the runner's MTP drafts
    # Structured output needs the tokenizer's vocabulary (bytes of every id) for its masks.
    tokenizer_path = Path(config.tokenizer or model_dir) / "tokenizer.json"
    grammar_compiler = None
    if tokenizer_path.is_file():
        grammar_compiler = GrammarCompiler(tokenizer_path, runner.sampler.vocab_size, model_config.eos_token_ids,
                                           cache_bytes=config.grammar_cache_bytes)
    return EngineCore(
        runner,
        kv_cache,
        scheduler_config,
        eos_token_ids=model_config.eos_token_ids,
        device=config.device,
        check_integrity_every_step=config.check_integrity_every_step,
        proposer=proposer,
        grammar_compiler=grammar_compiler,
        grammar_compile_timeout_s=config.grammar_compile_timeout_s,
    )
