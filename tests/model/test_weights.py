"""The shared weight loader: packed checkpoint tensors land in the right shard; gaps are errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenline.model.config import ModelConfig
from tokenline.model.llama import LlamaForCausalLM
from tokenline.model.weights import load_packed_weights, route


@pytest.fixture
def checkpoint() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A tiny Llama as transformers names and shapes it, untied so that lm_head is its own tensor."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    state = HFLlamaForCausalLM(hf_config).state_dict()
    return ModelConfig.from_dict({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]}), state


def test_route_matches_whole_name_parts() -> None:
    mapping = LlamaForCausalLM.packed_modules_mapping
    assert route("layers.0.self_attn.k_proj.weight", mapping) == ("layers.0.self_attn.qkv_proj.weight", 1)
    assert route("layers.3.mlp.up_proj.weight", mapping) == ("layers.3.mlp.gate_up_proj.weight", 1)
    # Our own merged name is not a checkpoint name to re-route, and nothing matches inside a part.
    assert route("layers.3.mlp.gate_up_proj.weight", mapping) == ("layers.3.mlp.gate_up_proj.weight", None)
    assert route("layers.0.mlp.down_proj.weight", mapping) == ("layers.0.mlp.down_proj.weight", None)


def test_packed_shards_land_in_order(checkpoint: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    config, state = checkpoint
    model = LlamaForCausalLM(config)
    load_packed_weights(model, state.items())
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    q, k, v = attn.qkv_proj.weight.split([32, 16, 16])
    assert torch.equal(q, state["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, state["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, state["model.layers.1.self_attn.v_proj.weight"])
    gate, up = mlp.gate_up_proj.weight.split(48)
    assert torch.equal(gate, state["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(up, state["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])


def test_a_missing_shard_is_named(checkpoint: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    config, state = checkpoint
    del state["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weights: \['layers.0.self_attn.qkv_proj.weight\[shard 1\]'\]"):
        load_packed_weights(LlamaForCausalLM(config), state.items())


def test_unexpected_or_misshapen_weights_are_errors(checkpoint: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    config, state = checkpoint
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.9.mlp.up_proj.weight'"):
        extra = ("model.layers.9.mlp.up_proj.weight", torch.zeros(1))
        load_packed_weights(LlamaForCausalLM(config), [*state.items(), extra])
    state["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(8, 32)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.v_proj.weight' has shape \(8, 32\), expected \(16, 32\)"):
        load_packed_weights(LlamaForCausalLM(config), state.items())


def test_no_lm_head_in_the_checkpoint_means_tied(checkpoint: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    config, state = checkpoint
    del state["lm_head.weight"]
    model = LlamaForCausalLM(config)
    load_packed_weights(model, state.items())
    assert model.lm_head.weight is model.embed_tokens.weight


def test_iter_safetensors_reads_what_safe_open_reads(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tokenline.model.weights import iter_safetensors

    tensors = {
        "b.weight": torch.randn(7, 5).to(torch.bfloat16),
        "a.ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "c.scalar": torch.tensor(2.5),
        "d.empty": torch.empty(0, 4),
        "e.half": torch.randn(3).half(),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ours = list(iter_safetensors(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert [name for name, _ in ours] == list(handle.keys())
        for name, tensor in ours:
            expected = handle.get_tensor(name)
            assert tensor.dtype == expected.dtype and tensor.shape == expected.shape and torch.equal(tensor, expected)
