"""The model registry: which architectures resolve, lazily, to classes that implement the interface."""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import pytest
import torch

from tokenline.model import registry
from tokenline.model.config import ModelConfig
from tokenline.model.interface import CausalLM
from tokenline.model.layers import MergedLinear
from tokenline.model.loader import model_class

# Tiny configs with every key each architecture reads (Qwen3.5: 3 DeltaNet layers, then full attention).
LLAMA = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": True,
}
QWEN3_5 = {
    **LLAMA, "num_hidden_layers": 4, "head_dim": 32,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
}
GEMMA3 = {
    **LLAMA, "num_hidden_layers": 6, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 8,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "query_pre_attn_scalar": 32,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
}
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen3ForCausalLM": {**LLAMA, "head_dim": 24},
    "Gemma3ForCausalLM": GEMMA3,
    "Qwen3_5ForCausalLM": QWEN3_5,
    "Qwen3_5ForConditionalGeneration": {"text_config": QWEN3_5, "tie_word_embeddings": False},
}


def tiny_config(architecture: str) -> ModelConfig:
    return ModelConfig.from_dict({**TINY_CONFIGS[architecture], "architectures": [architecture]})


def test_every_registered_architecture_has_a_tiny_config_here() -> None:
    assert set(registry.supported_architectures()) == set(TINY_CONFIGS)


def test_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"\['GPT2LMHeadModel'\] is not supported \(supported: .*LlamaForCausalLM"):
        ModelConfig.from_dict({**LLAMA, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        model_class("gpt2")


def test_first_supported_architecture_wins() -> None:
    config = ModelConfig.from_dict({**LLAMA, "architectures": ["SomethingElse", "MistralForCausalLM"]})
    assert config.architecture == "MistralForCausalLM"


def test_resolving_one_architecture_imports_no_other_model() -> None:
    # A fresh interpreter: this one has imported every model module already.
    code = (
        "import sys\n"
        "from tokenline.model.config import ModelConfig\n"
        "from tokenline.model import registry\n"
        "assert 'torch' not in sys.modules, 'reading the table must not need torch'\n"
        "from tokenline.model.loader import model_class\n"
        "model_class('LlamaForCausalLM')\n"
        "loaded = [m for m in ('qwen3', 'qwen3_5', 'gated_deltanet') if f'tokenline.model.{m}' in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("architecture", sorted(TINY_CONFIGS))
def test_every_architecture_implements_the_interface(architecture: str) -> None:
    cls = model_class(architecture)
    assert issubclass(cls, CausalLM) and not inspect.isabstract(cls)
    config = tiny_config(architecture)
    model = cls(config)
    # Every packed target is a merged module of the model, with a shard for each index mapped to it.
    merged = {name.rpartition(".")[2]: m for name, m in model.named_modules() if isinstance(m, MergedLinear)}
    for ours, shard in cls.packed_modules_mapping.values():
        assert ours in merged and shard < len(merged[ours].output_sizes)


@pytest.mark.parametrize("architecture", sorted(TINY_CONFIGS))
def test_cache_sizes_from_the_config_are_the_cache_tensors(architecture: str) -> None:
    # The memory plan and the engine size the pool with the classmethods, from the config alone.
    config = tiny_config(architecture)
    cls = model_class(architecture)
    with torch.device("meta"):
        model = cls(config)
    num_blocks, block_size, num_slots = 3, 4, 5
    caches = model.make_caches(num_blocks, block_size, num_slots, torch.bfloat16, torch.device("meta"))
    kv_bytes = sum(c.nbytes for c in caches if isinstance(c, torch.Tensor))
    state_bytes = sum(t.nbytes for c in caches if isinstance(c, tuple) for t in c)
    assert len(caches) == config.num_hidden_layers
    assert kv_bytes == cls.kv_bytes_per_token(config, 2) * num_blocks * block_size
    assert state_bytes == cls.state_bytes_per_sequence(config, 2) * num_slots
