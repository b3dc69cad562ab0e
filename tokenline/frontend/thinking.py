"""``reasoning_effort`` mapped onto a chat template's thinking switch.

Open models have no effort dial; hybrid reasoning models (Qwen3 and its kin) have a template
variable, ``enable_thinking``, that turns the thought on or off. OpenAI's efforts map onto it:
"none" and "minimal" ask for no thought, every other effort for one. A template without the
switch renders the same either way, so the effort changes nothing there (as on OpenAI's own
non-reasoning models).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, get_args

__all__ = ["REASONING_EFFORTS", "THINKING_SWITCH", "ReasoningEffort", "has_thinking_switch", "thinking_kwargs"]

# The values the openai SDK (3.x) sends for `reasoning_effort` / `reasoning.effort`.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)
THINKING_SWITCH = "enable_thinking"
_NO_THOUGHT = frozenset({"none", "minimal"})


def has_thinking_switch(templates: Iterable[str]) -> bool:
    """Whether any of the model's chat templates reads the thinking switch."""
    return any(THINKING_SWITCH in template for template in templates)


def thinking_kwargs(
    effort: str | None, chat_template_kwargs: Mapping[str, Any] | None, switch: bool
) -> Mapping[str, Any] | None:
    """The template variables with the effort applied. An explicit ``enable_thinking`` in
    ``chat_template_kwargs`` wins: it is the more specific request."""
    if effort is None or not switch or THINKING_SWITCH in (chat_template_kwargs or {}):
        return chat_template_kwargs
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    return {**(chat_template_kwargs or {}), THINKING_SWITCH: effort not in _NO_THOUGHT}
