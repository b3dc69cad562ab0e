"""The one check of a request's size against the model's context, and its messages (vLLM's and
OpenAI's wording). The request processor runs it on every request in the caller's terms; the
engine runs it again only for requests handed to it directly (the offline tools, the simulator),
and adds what only it knows: whether the request fits the KV pool at all."""

from __future__ import annotations

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the OpenAI error code of both refusals


def prompt_overflow(prompt_len: int, max_model_len: int) -> str | None:
    """Why a prompt leaves no room for one generated token, or None when it fits."""
    if prompt_len < max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens. Please reduce the length of the prompt.")


def completion_overflow(prompt_len: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt plus ``max_tokens`` exceeds the context, or None when it fits."""
    if prompt_len + max_tokens <= max_model_len:
        return None
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the prompt or of the completion.")
