"""Build a model from an HF-format directory: config, safetensors weights, target dtype and device."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tokenline.model.config import ModelConfig
from tokenline.model.layers import RotaryEmbedding, prepare_for_inference
from tokenline.model.llama import LlamaForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto`` is bfloat16: on CPUs with AVX-512 BF16/AMX and on GPUs it is the faster correct choice."""
    if name == "auto":
        return torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def model_class(architecture: str) -> type[torch.nn.Module]:
    # Imported on use: a server for one family never loads another's code.
    if architecture in ("LlamaForCausalLM", "MistralForCausalLM"):
        return LlamaForCausalLM
    if architecture == "Qwen3ForCausalLM":
        from tokenline.model.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM
    if architecture == "Qwen3_5ForCausalLM":
        from tokenline.model.qwen3_5 import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM
    raise ValueError(f"no model class for architecture {architecture!r}")


def load_model(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> torch.nn.Module:
    cls = model_class(config.architecture)
    if not issubclass(cls, LlamaForCausalLM):
        # The hybrid computes its partial rotary per step and owns every parameter itself.
        model = cls(config).to(device=device, dtype=dtype)
        model.load_weights(iter_safetensors(model_dir))
        prepare_for_inference(model)
        return model.eval()
    # Build on the meta device so no time is spent initialising weights we overwrite anyway.
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # to_empty unties shared parameters
    model.rotary = RotaryEmbedding(config.head_dim, max_model_len, config.rope_theta, config.rope_scaling).to(device)
    model.to(dtype)
    model.load_weights(iter_safetensors(model_dir))
    prepare_for_inference(model)
    return model.eval()
