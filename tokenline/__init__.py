"""tokenline: an LLM inference server with paged KV cache, continuous batching and an OpenAI API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tokenline.llm import LLM
    from tokenline.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy, so that `import tokenline` (the CLI's --help, say) does not pay for importing torch.
    if name == "LLM":
        from tokenline.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenline.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
