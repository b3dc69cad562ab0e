"""Import a GGUF file (llama or gemma3 architecture) into a Hugging Face–format model directory.

The output is what tokenline (and transformers) load from any local checkpoint: ``config.json``,
float32 ``model.safetensors`` with HF tensor names, ``tokenizer.json`` + ``tokenizer_config.json``,
``generation_config.json`` and ``chat_template.jinja`` (when the file has one). Tensors of any
type the file holds (F32, Q8_0, Q5_0, Q4_K, Q6_K, ...) are dequantized with the ``gguf`` package;
transformers is used only here, at import time, to build the tokenizer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

# GGUF tensor name (after "blk.N." for per-layer tensors) -> HF name (after "model.layers.N."), per
# GGUF architecture.
LAYER_TENSORS = {
    "llama": {
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    },
    "gemma3": {
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        # Four norms a layer: around attention, then around the MLP.
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def import_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write an HF-format model directory for ``gguf_path`` into ``out_dir`` (which must exist).

    Raises ``ValueError`` for GGUF files whose architecture is neither ``llama`` nor ``gemma3``.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in LAYER_TENSORS:
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported; only "
                         f"{' and '.join(repr(a) for a in LAYER_TENSORS)} are")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # llama.cpp bakes llama3-style rope scaling into a frequency tensor; HF needs the original
        # scaling parameters, which the file no longer has.
        raise ValueError(f"{gguf_path}: precomputed rope frequency factors (rope_freqs) are not supported")

    config = (write_gemma3_config if arch == "gemma3" else write_config)(meta, reader, out_dir)
    write_weights(_convert_tensors(reader, arch, config, progress), out_dir / "model.safetensors")
    write_tokenizer(gguf_path, meta, config, out_dir)
    write_generation_config(meta, out_dir)


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """Scalar and string fields of the GGUF header; big arrays (the vocabulary) are left out."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > 64:
            continue
        meta[key] = field.contents()
    return meta


def write_config(meta: dict[str, Any], reader: GGUFReader, out_dir: Path) -> dict[str, Any]:
    """Write ``config.json`` (a ``LlamaForCausalLM`` config) and return it."""
    p = "llama."
    hidden = int(meta[p + "embedding_length"])
    heads = int(meta[p + "attention.head_count"])
    vocab_size = meta.get(p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": int(meta.get(p + "attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # Kept as the float32 value the file stores, so it equals what transformers reads.
        "rms_norm_eps": float(meta[p + "attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta[p + "context_length"]),
        "vocab_size": int(vocab_size),
        # llama.cpp omits output.weight when the head shares the embedding matrix.
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    scaling_type = meta.get(p + "rope.scaling.type")
    if scaling_type and scaling_type != "none":
        config["rope_scaling"] = {"rope_type": scaling_type, "factor": float(meta[p + "rope.scaling.factor"])}
        if p + "rope.scaling.original_context_length" in meta:
            original = int(meta[p + "rope.scaling.original_context_length"])
            config["rope_scaling"]["original_max_position_embeddings"] = original
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def write_gemma3_config(meta: dict[str, Any], reader: GGUFReader, out_dir: Path) -> dict[str, Any]:
    """Write ``config.json`` (a ``Gemma3ForCausalLM`` text config, as transformers derives it from
    the file) and return it."""
    p = "gemma3."
    layers = int(meta[p + "block_count"])
    # Every 6th layer is global (transformers' and llama.cpp's Gemma 3 pattern; the file has no key for it).
    pattern = 6
    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(p + "rope.freq_base", 1e6))}
    scaling_type = meta.get(p + "rope.scaling.type")
    if scaling_type == "linear":  # the 4B-27B checkpoints stretch the global layers' RoPE 8x
        full_rope.update(rope_type="linear", factor=float(meta[p + "rope.scaling.factor"]))
    elif scaling_type not in (None, "none"):
        raise ValueError(f"gemma3 rope scaling {scaling_type!r} is not supported")
    heads = int(meta[p + "attention.head_count"])
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(meta[p + "embedding_length"]),
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": int(meta[p + "attention.key_length"]),
        "hidden_activation": "gelu_pytorch_tanh",
        # The file does not say; transformers' Gemma3TextConfig default (= head_dim for 270M/1B).
        "query_pre_attn_scalar": 256,
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "rms_norm_eps": float(meta[p + "attention.layer_norm_rms_epsilon"]),
        "sliding_window": int(meta[p + "attention.sliding_window"]),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "max_position_embeddings": int(meta[p + "context_length"]),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of attn_q / attn_k.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ... so its converter interleaves the two
    halves of each head's rows; HF rotates (x_i, x_{i + d/2}). Per head the GGUF rows are ordered
    [r0, r_{d/2}, r1, r_{d/2+1}, ...]; this puts them back to [r0, r1, ..., r_{d/2}, ...].
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_tensors(
    reader: GGUFReader, arch: str, config: dict[str, Any], progress: bool
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32 under its HF name: llama's Q/K rows back in HF order,
    gemma3's norm weights back to HF's ``w`` (llama.cpp stores the ``1 + w`` its kernels multiply by)."""
    tensors: dict[str, torch.Tensor] = {}
    layer_tensors = LAYER_TENSORS[arch]
    for t in tqdm(reader.tensors, desc="Importing GGUF tensors", unit="tensor", disable=not progress):
        match = _LAYER_NAME.fullmatch(t.name)
        if match and match.group(2) in layer_tensors:
            name = f"model.layers.{match.group(1)}.{layer_tensors[match.group(2)]}"
        elif t.name in GLOBAL_TENSORS:
            name = GLOBAL_TENSORS[t.name]
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in a {arch} GGUF")
        # dequantize returns numpy in row-major (HF) shape: [out_features, in_features]. For F32
        # tensors that is a read-only view of the memory-mapped file, hence the copy.
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if arch == "gemma3":
            if name.endswith("norm.weight"):
                w -= np.float32(1.0)  # as transformers' GGUF loader does, in float32
        elif name.endswith("q_proj.weight"):
            w = _unpermute_rotary(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rotary(w, config["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    return tensors


def write_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write the float32 state dict as safetensors."""
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_tokenizer(gguf_path: Path, meta: dict[str, Any], config: dict[str, Any], out_dir: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``.

    transformers' GGUF tokenizer converter is the reference the tests compare against, so it
    builds the fast tokenizer; the config around it is written from the GGUF header.
    """
    from transformers import AutoTokenizer  # heavy import, and needed only at import time

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    tok.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    template = meta.get("tokenizer.chat_template")
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    if template is not None:
        tokenizer_config["chat_template"] = template
        (out_dir / "chat_template.jinja").write_text(template)
    text = json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text)


def write_generation_config(meta: dict[str, Any], out_dir: Path) -> None:
    """Write ``generation_config.json`` with the special token ids."""
    generation = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
