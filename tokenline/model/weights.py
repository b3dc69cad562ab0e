"""Reading checkpoints and the one weight loader every model uses.

HF checkpoints store q/k/v, gate/up, ... as separate tensors; our models fuse them into one
``MergedLinear`` each. A model's ``packed_modules_mapping`` says which checkpoint module goes to
which shard of which merged module; everything else is copied by name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from tokenline.model.layers import MergedLinear

if TYPE_CHECKING:
    from tokenline.model.interface import CausalLM


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    for path in files:
        yield from _read_one_by_one(path)


def _read_one_by_one(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor read into its own buffer: no mapping of the whole file, whose pages would count
    in the process's peak RSS until it is closed (a float32 checkpoint is twice the bf16 model)."""
    with path.open("rb") as f:
        header_len = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        if any(info["dtype"] not in _SAFETENSORS_DTYPES for info in header.values()):
            with safe_open(str(path), framework="pt") as handle:  # a dtype we do not read ourselves
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
            return
        for name in sorted(header):
            info = header[name]
            start, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=_SAFETENSORS_DTYPES[info["dtype"]])
            if end > start:
                f.seek(8 + header_len + start)
                if f.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != end - start:
                    raise ValueError(f"{path}: tensor {name!r} is cut short")
            yield name, tensor


def route(name: str, mapping: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """Our parameter for a checkpoint name and the shard inside it (None: the whole parameter).

    ``layers.0.self_attn.k_proj.weight`` with ``{"k_proj": ("qkv_proj", 1)}`` is shard 1 of
    ``layers.0.self_attn.qkv_proj.weight``. Whole dotted parts match, never substrings (``up_proj``
    must not match inside ``gate_up_proj``).
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in mapping:
            parts[i], shard = mapping[part]
            return ".".join(parts), shard
    return name, None


def load_packed_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into ``model``, each to its parameter or shard; every piece must arrive."""
    # Tie first: building on the meta device and ``to_empty`` unties shared parameters.
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    tied = model.lm_head.weight is model.embed_tokens.weight
    params = dict(model.named_parameters())  # a tied lm_head is not listed: it is embed_tokens
    loaded: set[tuple[str, int | None]] = set()
    for checkpoint_name, tensor in weights:
        name = model.checkpoint_name(checkpoint_name)
        # Old checkpoints store RoPE's inverse frequencies; we compute them.
        if name is None or name.startswith("rotary_emb.") or (tied and name == "lm_head.weight"):
            continue
        target, shard = route(name, model.packed_modules_mapping)
        param = params.get(target)
        if param is None:
            raise ValueError(f"unexpected weight {checkpoint_name!r} in checkpoint")
        rows = param
        if shard is not None:
            merged = _owner(model, target)
            if not isinstance(merged, MergedLinear):
                raise TypeError(f"{target!r} is packed but its module is not a MergedLinear")
            rows = param.narrow(0, merged.shard_offset(shard), merged.output_sizes[shard])
        if rows.shape != tensor.shape:
            raise ValueError(
                f"weight {checkpoint_name!r} has shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}"
            )
        with torch.no_grad():
            rows.copy_(tensor)
        loaded.add((target, shard))

    if not tied and ("lm_head.weight", None) not in loaded and ("embed_tokens.weight", None) in loaded:
        # Some multimodal configs state tying only where we do not read it; no lm_head in the
        # checkpoint can only mean a tied one.
        model.lm_head.weight = model.embed_tokens.weight
        del params["lm_head.weight"]
    missing = sorted(f"{name}[shard {shard}]" if shard is not None else name
                     for name, shard in _expected_pieces(model, params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}")


def _owner(model: torch.nn.Module, param_name: str) -> torch.nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def _expected_pieces(model: CausalLM, params: dict[str, torch.nn.Parameter]) -> set[tuple[str, int | None]]:
    """Every (parameter, shard) a complete checkpoint fills: each shard of merged modules, the rest whole."""
    pieces: set[tuple[str, int | None]] = set()
    for name in params:
        owner = _owner(model, name)
        if isinstance(owner, MergedLinear):
            pieces |= {(name, shard) for shard in range(len(owner.output_sizes))}
        else:
            pieces.add((name, None))
    return pieces
