"""The model's shape, read from an HF-format ``config.json`` (and ``generation_config.json``).

Only fields every decoder has live here; a model reads its own extra keys from ``raw`` (see its
class in the registry). No torch: the API process reads configs too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenline.model import registry


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    # Per layer: "full_attention", "sliding_attention" (sees the last ``sliding_window`` positions)
    # or "linear_attention" (recurrent state, no KV), as HF configs name them.
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None  # tokens a sliding_attention layer attends to, itself included
    raw: dict[str, Any] = field(default_factory=dict)  # the whole (text) config, for model-specific keys

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        return cls.from_dict(json.loads((model_dir / "config.json").read_text()), model_dir)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], model_dir: Path | None = None) -> ModelConfig:
        architectures = list(raw.get("architectures") or [])
        raw = text_config(raw)
        architecture = registry.resolve_architecture(architectures)
        if architecture is None:
            raise ValueError(
                f"{model_dir or 'config'}: architecture {architectures or raw.get('model_type')} is not supported "
                f"(supported: {', '.join(registry.supported_architectures())})"
            )
        generation_path = model_dir / "generation_config.json" if model_dir is not None else None
        generation = json.loads(generation_path.read_text()) if generation_path and generation_path.exists() else {}
        heads = raw["num_attention_heads"]
        rope_scaling = raw.get("rope_scaling") or (raw.get("rope_parameters") or None)
        if isinstance(rope_scaling, dict) and isinstance(rope_scaling.get("full_attention"), dict):
            # RoPE per layer type (Gemma 3): the trunk's is the full-attention layers'; a model with
            # sliding layers reads theirs from ``raw``.
            rope_scaling = dict(rope_scaling["full_attention"])
        rope_theta = raw.get("rope_theta")
        if rope_theta is None and isinstance(rope_scaling, dict):
            rope_theta = rope_scaling.get("rope_theta")
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            generation_config=generation,
            layer_types=(layer_types := list(raw.get("layer_types") or _default_layer_types(raw))),
            sliding_window=raw.get("sliding_window") if "sliding_attention" in layer_types else None,
            raw=raw,
        )

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.generation_config.get("eos_token_id")
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list) else [eos]

    @property
    def num_full_attention_layers(self) -> int:
        return sum(1 for t in self.layer_types if t != "linear_attention")

    @property
    def num_linear_attention_layers(self) -> int:
        return len(self.layer_types) - self.num_full_attention_layers

    @property
    def num_sliding_attention_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == "sliding_attention")

    @property
    def is_hybrid(self) -> bool:
        return self.num_linear_attention_layers > 0

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies: only attention layers (full and sliding) store any."""
        return 2 * self.num_full_attention_layers * self.num_key_value_heads * self.head_dim * dtype_size


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config, whether config.json is the text model's or a multimodal one's.

    In multimodal checkpoints the text fields sit under ``text_config``; top-level keys (such as
    ``tie_word_embeddings``) still apply where the text config does not say otherwise.
    """
    nested = raw.get("text_config")
    if not nested:
        return raw
    merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    merged.update(nested)
    return merged


def _default_layer_types(raw: dict[str, Any]) -> list[str]:
    """Without ``layer_types``: every ``full_attention_interval``-th layer is full attention and the
    others linear (how hybrid configs state it), every ``sliding_window_pattern``-th full and the
    others sliding (older Gemma 3 configs), or all full attention."""
    interval = raw.get("full_attention_interval")
    layers = raw["num_hidden_layers"]
    pattern = raw.get("sliding_window_pattern")
    if raw.get("sliding_window") and pattern:
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if not interval:
        return ["full_attention"] * layers
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def load_generation_config(source: str, model_dir: Path) -> dict[str, Any]:
    """vLLM's ``--generation-config``: where unset sampling fields take their defaults from.
    ``auto``: the model's ``generation_config.json``; ``vllm``: none (neutral defaults); anything
    else: a folder holding a ``generation_config.json``. Raises ``ValueError`` for a folder without one."""
    if source == "vllm":
        return {}
    folder = model_dir if source == "auto" else Path(source).expanduser()
    path = folder / "generation_config.json"
    if source == "auto":
        return json.loads(path.read_text()) if path.is_file() else {}
    if not path.is_file():
        raise ValueError(f"--generation-config {source!r}: expected 'auto', 'vllm' or a folder with a "
                         "generation_config.json, and there is no such file")
    try:
        loaded = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"--generation-config: {path} is not valid JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"--generation-config: {path} must hold a JSON object")
    return loaded
