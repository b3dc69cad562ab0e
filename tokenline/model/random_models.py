"""Builders of tiny models with seeded random weights, saved in HF format, for tests and
``tokenline make-test-model``.

Nothing here downloads anything: the architecture comes from ``transformers`` (so the weight names
are exactly the ones real checkpoints use) and the weights from a seeded generator. Only weights and
configs are written; a caller that needs a tokenizer adds one (``frontend.qwen_vocab``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Qwen3.5/3.6 vocabulary: 248,044 BPE ranks, specials from 248,044, the embedding padded to 248,320.
QWEN3_5_VOCAB_SIZE = 248_320
QWEN3_5_ENDOFTEXT_ID = 248_044
QWEN3_5_IM_END_ID = 248_046


def make_qwen3_5_tiny(out_dir: Path, seed: int = 0, mtp_layers: int = 1) -> None:
    """Write a 4-layer Qwen3.5 hybrid (3 Gated DeltaNet layers, then 1 gated full-attention layer).

    Shapes are small but keep every structural feature of the real models: grouped value heads in
    the DeltaNet (4 value heads on 2 key heads), GQA and partial rotary (a quarter of the head) in
    full attention, the attention output gate, tied embeddings and the padded vocabulary (the real
    Qwen3.5 tokenizer, ``frontend.qwen_vocab.build_qwen_tokenizer``, knows 248,077 of its ids).
    With ``mtp_layers`` > 0 the checkpoint also carries a multi-token-prediction head under
    ``mtp.*``, as the real ones do (:func:`add_qwen3_5_mtp_weights`); the text model's weights do
    not depend on it.
    """
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=QWEN3_5_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=QWEN3_5_IM_END_ID,
        pad_token_id=QWEN3_5_ENDOFTEXT_ID,
    )
    _save_random(lambda: Qwen3_5ForCausalLM(config), Path(out_dir), seed)
    if mtp_layers:
        add_qwen3_5_mtp_weights(Path(out_dir), mtp_layers, seed)
    generation = {"eos_token_id": QWEN3_5_IM_END_ID, "pad_token_id": QWEN3_5_ENDOFTEXT_ID}
    (Path(out_dir) / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def qwen3_5_0_8b_text_config() -> Any:
    """The text model of Qwen3.5-0.8B (``Qwen/Qwen3.5-0.8B``'s ``text_config``), as a transformers config.

    24 layers in the released pattern (three Gated DeltaNet layers, then one gated full-attention
    layer), hidden 1,024, MLP 3,584; full attention: 8 query heads of 256 on 2 KV heads, a quarter of
    each head rotary; DeltaNet: 16 key and 16 value heads of 128, a 4-tap convolution; tied
    embeddings over the padded 248,320 vocabulary. ~0.75 B parameters (0.25 B of them the
    embedding), the size of the checkpoint less its vision tower and MTP head.
    """
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=QWEN3_5_VOCAB_SIZE,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=262_144,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=QWEN3_5_IM_END_ID,
        pad_token_id=QWEN3_5_ENDOFTEXT_ID,
    )


def make_qwen3_5_0_8b(out_dir: Path, seed: int = 0) -> None:
    """Write Qwen3.5-0.8B's text model (:func:`qwen3_5_0_8b_text_config`) with seeded random weights
    in bfloat16 (1.5 GB), no MTP head: a hybrid of realistic size for serving benchmarks, where every
    server reads the same file."""
    from transformers import Qwen3_5ForCausalLM

    config = qwen3_5_0_8b_text_config()
    _save_random(lambda: Qwen3_5ForCausalLM(config), Path(out_dir), seed, dtype=torch.bfloat16)
    generation = {"eos_token_id": QWEN3_5_IM_END_ID, "pad_token_id": QWEN3_5_ENDOFTEXT_ID}
    (Path(out_dir) / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def add_qwen3_5_mtp_weights(out_dir: Path, num_layers: int = 1, seed: int = 0) -> None:
    """Add seeded random MTP weights to a saved Qwen3.5 checkpoint, in the real layout.

    Real Qwen3.5 / Qwen3-Next checkpoints keep the multi-token-prediction head beside the text
    model: ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` (zero-centred norms),
    ``mtp.fc`` [hidden, 2 * hidden], ``mtp.layers.{i}.*`` (full-attention decoder layers, named as
    the text model's) and ``mtp.norm``; the embedding and the LM head are the text model's. The
    config says how many layers with ``mtp_num_hidden_layers``.
    """
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    config_path = out_dir / "config.json"
    raw = json.loads(config_path.read_text())
    config = Qwen3_5TextConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version")})
    full = config.layer_types.index("full_attention")  # an index whose layer type is full attention
    torch.manual_seed(seed + 1)  # its own stream: the text model's weights stay what they were
    hidden = config.hidden_size
    tensors: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        layer = Qwen3_5DecoderLayer(config, full).to(torch.float32)
        for name, param in layer.state_dict().items():
            tensors[f"mtp.layers.{i}.{name}"] = param.detach().clone()
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.zeros(hidden)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
    for name, tensor in tensors.items():
        if name.endswith("norm.weight"):  # perturbed like the text model's (see _save_random)
            tensor.add_(0.1 * torch.randn_like(tensor))
        elif tensor.dim() == 2 and name != "mtp.fc.weight":
            tensor.normal_(0.0, 0.02)  # HF's initializer range; a bare layer is left uninitialised
    path = out_dir / "model.safetensors"
    weights = load_file(str(path))
    weights.update({name: t.contiguous() for name, t in tensors.items()})
    save_file(weights, str(path), metadata={"format": "pt"})
    raw["mtp_num_hidden_layers"] = num_layers
    config_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def scale_qwen3_5_linear_outputs(out_dir: Path, factor: float) -> None:
    """Scale a saved Qwen3.5's Gated DeltaNet output projections by ``factor``.

    With small random weights and tied embeddings the tiny hybrid mostly repeats its last token,
    whatever its recurrent state holds; louder linear layers make the next token depend on that
    state, so a test can see a state that went wrong (e.g. one holding rejected drafts).
    """
    from safetensors.torch import load_file, save_file

    path = Path(out_dir) / "model.safetensors"
    weights = load_file(str(path))
    for name in weights:
        if ".linear_attn.out_proj." in name:
            weights[name] = weights[name] * factor
    save_file(weights, str(path), metadata={"format": "pt"})


def make_qwen3_tiny(out_dir: Path, seed: int = 0) -> None:
    """Write a 2-layer dense Qwen3 (GQA, explicit head_dim, q/k norms, tied embeddings), small vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,  # not hidden / heads, as in the real models
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
    )
    _save_random(lambda: Qwen3ForCausalLM(config), Path(out_dir), seed)


def make_sliding_tiny(out_dir: Path, seed: int = 0, window: int = 16) -> None:
    """Write a 6-layer dense Qwen3 whose layers 1-2 and 4-5 use sliding-window attention over
    ``window`` positions and layers 3 and 6 attend globally (Gemma 3's pattern, shortened): a model
    with two kinds of KV layer, and a transformers reference that masks the same window."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    )
    _save_random(lambda: Qwen3ForCausalLM(config), Path(out_dir), seed)


def _save_random(build: Callable[[], Any], out_dir: Path, seed: int, dtype: torch.dtype = torch.float32) -> None:
    """A transformers model built with seeded weights, saved in ``dtype`` as safetensors with its config.

    HF initialises norm weights at one (and Qwen3.5's ``1 + w`` norms at zero), which would hide a
    wrong norm variant; a seeded perturbation makes every norm weight count in tests.
    """
    torch.manual_seed(seed)
    model = build().to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model = model.to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)


def make_gemma3_tiny(out_dir: Path, seed: int = 0) -> None:
    """Write a 3-layer Gemma 3 text model: two sliding-window layers (window 8) and a global one
    whose RoPE is stretched linearly, a score scale other than 1/sqrt(head_dim), one KV head."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=48,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    _save_random(lambda: Gemma3ForCausalLM(config), Path(out_dir), seed)
