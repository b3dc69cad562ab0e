"""The architectures tokenline serves: HF architecture name -> the module and class implementing it.

Adding an architecture is one model file (a :class:`~tokenline.model.interface.CausalLM`) plus one
line in ``_MODELS``. Model modules are imported on first use (``loader.model_class``), so a server for
one family never loads another's code, and reading the table needs no torch: the API process checks
configs with it.
"""

from __future__ import annotations

from collections.abc import Sequence

# HF architecture name: (module under tokenline.model, class name).
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),  # Mistral without sliding window is Llama
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    # The multimodal checkpoint: we serve its text decoder.
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForCausalLM"),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_MODELS))


def resolve_architecture(architectures: Sequence[str]) -> str | None:
    """The first of a config's ``architectures`` that we serve, or None."""
    return next((a for a in architectures if a in _MODELS), None)


def implementation(architecture: str) -> tuple[str, str]:
    """(module under tokenline.model, class name) implementing ``architecture``."""
    entry = _MODELS.get(architecture)
    if entry is None:
        raise ValueError(
            f"architecture {architecture!r} is not supported (supported: {', '.join(supported_architectures())})"
        )
    return entry
