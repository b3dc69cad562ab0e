"""Prompt logprobs (vLLM's ``prompt_logprobs``): known tokens scored from a prefill's hidden states.

Each position's logits are a vocabulary-wide row, so a long prompt's rows are never all
materialised: the rows go through the LM head a slice at a time, and of each row only the known
token's logprob and rank and the top k are kept. The distribution is the model's own (log_softmax
of the logits over the tokenizer's vocabulary), untouched by sampling settings, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenline.model.batch import TokenLogprobs

# Logits held at once while scoring (rows x vocabulary, float32): 32 MiB; the log_softmax beside
# them doubles it. 170 rows of the default model's vocabulary, 33 of Qwen3.5's.
SCORE_SLICE_ELEMENTS = 1 << 23


def score_tokens(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    num_top: int,
    vocab_size: int,
    slice_elements: int = SCORE_SLICE_ELEMENTS,
) -> list[TokenLogprobs]:
    """The logprob and rank of ``targets[i]`` under the logits of ``hidden[i]``, and the ``num_top``
    most likely tokens there. ``vocab_size``: the tokenizer's (padding columns are no token)."""
    rows_per_slice = max(1, slice_elements // vocab_size)
    out: list[TokenLogprobs] = []
    for begin in range(0, hidden.shape[0], rows_per_slice):
        end = min(begin + rows_per_slice, hidden.shape[0])
        logprobs = compute_logits(hidden[begin:end])[:, :vocab_size].float().log_softmax(dim=-1)
        wanted = targets[begin:end].unsqueeze(1)
        chosen = logprobs.gather(1, wanted)
        # vLLM's rank: how many tokens are at least as likely as this one (itself included).
        ranks = (logprobs >= chosen).sum(dim=-1).tolist()
        chosen_list = chosen.squeeze(1).tolist()
        if num_top:
            top_values, top_ids = logprobs.topk(num_top, dim=-1)  # sorted desc
            tops = [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
        else:
            tops = [[] for _ in chosen_list]
        out.extend(TokenLogprobs(value, top, rank) for value, top, rank in zip(chosen_list, tops, ranks))
    return out
