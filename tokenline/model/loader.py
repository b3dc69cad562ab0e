"""Build a model from an HF-format directory: config, safetensors weights, target dtype and device."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from tokenline.model.config import ModelConfig
from tokenline.model import cpu_kernels
from tokenline.model.host_memory import retain_freed_memory, return_freed_memory
from tokenline.model.interface import CausalLM
from tokenline.model.layers import prepare_for_inference
from tokenline.model.mtp_checkpoint import check_mtp_checkpoint
from tokenline.model.registry import implementation
from tokenline.model.weights import iter_safetensors, load_packed_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto`` is bfloat16 on GPUs and on CPUs with native bf16 (AVX-512 BF16/AMX), where it is the
    faster correct choice; float32 on other CPUs, where bf16 would be emulated (and slower)."""
    if name == "auto":
        if torch.device(device).type == "cpu" and not cpu_kernels.cpu_has_native_bf16():
            return torch.float32
        return torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def model_class(architecture: str) -> type[CausalLM]:
    """The class implementing ``architecture``, importing its module now if it is not yet."""
    module_name, class_name = implementation(architecture)
    module = importlib.import_module(f"tokenline.model.{module_name}")
    cls: type[CausalLM] = getattr(module, class_name)
    return cls


def load_model(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, mtp: bool = False,
    quantization: str | None = None,
) -> CausalLM:
    """``mtp``: also build and load the checkpoint's multi-token-prediction head (``--speculative mtp``);
    ``quantization``: q4_1 or q8_0 blocks for the linear layers (model/quantization.py)."""
    if mtp:
        check_mtp_checkpoint(model_dir, config)  # a clear error, not a list of missing weights
    # Build on the meta device so no time is spent initialising weights we overwrite anyway; the
    # loader then fills every parameter (and fails on any it cannot).
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
        if mtp:
            model.enable_mtp()
    if device.type == "cpu":
        retain_freed_memory()  # before the first allocation: a step's activations are reused, not re-faulted
    _allocate(model, device, dtype)
    load_packed_weights(model, iter_safetensors(model_dir))
    prepare_for_inference(model, quantization)
    return_freed_memory()
    return model.eval()


def _allocate(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter uninitialised storage, floats in ``dtype``. Not ``to_empty``: on
    meta tensors it goes through torch's Python references, which import sympy (~0.8 s a start)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            target = dtype if param.is_floating_point() else param.dtype
            module._parameters[name] = torch.nn.Parameter(
                torch.empty(param.shape, dtype=target, device=device), requires_grad=param.requires_grad)
        for name, buffer in module.named_buffers(recurse=False):
            target = dtype if buffer.is_floating_point() else buffer.dtype
            module._buffers[name] = torch.empty(buffer.shape, dtype=target, device=device)
