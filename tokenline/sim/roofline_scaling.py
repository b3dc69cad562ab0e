"""Step times of another model or machine, derived from the calibrated ones by a roofline ratio.

For a step with features f (prefill tokens P, decode sequences D, attended context tokens C,
prefill chunks' query-key pairs Q; N = P + D tokens computed), a model on a machine has the lower bound

    T(f) = max(bytes(f) / bandwidth, flops(f) / matmul peak)
    bytes(f) = weight bytes + C · KV bytes per token + 2 · D · state bytes per sequence
    flops(f) = 2 · N · matmul parameters + 4 · (C + Q) · heads · head_dim · full-attention layers

(``bench roofline`` counts a decode step the same way). The what-if step time is the calibrated
prediction scaled by the ratio of the two bounds, plus the per-step host overhead:

    step'(f) = model(f) · T_target(f) / T_calibrated(f) + overhead

so the calibrated machine's efficiency against its own roofline — the fixed cost ``a`` included,
which on the calibration box is mostly reading the weights — is assumed to carry over to the target.
Limits: that assumption (kernels, launch overheads and batching efficiency differ between a CPU and
a GPU); a prefill chunk's context is counted in C as well as in Q (once, against its tokens times
it: a rounding error); no tensor parallelism or multi-GPU communication; no quantization beyond the
machine's dtype; the host's per-step overhead stays as measured here unless the machine file states
one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenline.model.config import ModelConfig
from tokenline.sim.machine import Machine
from tokenline.sim.step_model import StepFeatures


@dataclass(frozen=True)
class ModelCost:
    """What one step of a model reads and computes, per unit of each step feature."""

    num_parameters: int
    weight_bytes: int  # every parameter, as held in memory
    matmul_bytes: int  # read once per step: the linear layers and lm_head (not the embedding table)
    matmul_params: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    attention_flops_per_context_token: int
    num_layers: int
    sliding_share: float = 0.0  # of the attention layers, the sliding-window ones

    def attended(self, f: StepFeatures) -> tuple[float, float]:
        """The step's context tokens and query-key pairs as the attention layers read them on
        average: sliding-window layers see at most their window (``StepFeatures.windowed_*``)."""
        if not self.sliding_share or f.windowed_context_tokens is None:
            return f.attended_context_tokens, f.prefill_attention_pairs
        s = self.sliding_share
        return ((1 - s) * f.attended_context_tokens + s * f.windowed_context_tokens,
                (1 - s) * f.prefill_attention_pairs + s * (f.windowed_attention_pairs or 0))


def model_cost(config: ModelConfig, dtype_size: int) -> ModelCost:
    """Count a model's bytes and FLOPs from its config (built on the meta device: no memory)."""
    from tokenline.model.loader import model_class  # torch, only when a what-if asks
    from tokenline.model.plan import count_parameters

    params = count_parameters(config)
    # An untied input embedding is a lookup of N rows, not a matmul: leave it out of the per-step read.
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    matmul = params - embedding
    cls = model_class(config.architecture)
    return ModelCost(
        num_parameters=params,
        weight_bytes=params * dtype_size,
        matmul_bytes=matmul * dtype_size,
        matmul_params=matmul,
        kv_bytes_per_token=cls.kv_bytes_per_token(config, dtype_size),
        state_bytes_per_sequence=cls.state_bytes_per_sequence(config, dtype_size),
        attention_flops_per_context_token=4 * config.num_attention_heads * config.head_dim
        * config.num_full_attention_layers,
        num_layers=config.num_hidden_layers,
        sliding_share=config.num_sliding_attention_layers / max(1, config.num_full_attention_layers),
    )


def roofline_seconds(cost: ModelCost, machine: Machine, f: StepFeatures) -> float:
    """The lower bound on one step's time (the formula in the module docstring)."""
    context, pairs = cost.attended(f)
    num_bytes = (cost.matmul_bytes + context * cost.kv_bytes_per_token
                 + 2 * f.decode_seqs * cost.state_bytes_per_sequence)
    flops = (2 * (f.prefill_tokens + f.decode_seqs) * cost.matmul_params
             + (context + pairs) * cost.attention_flops_per_context_token)
    return max(num_bytes / machine.bandwidth_bytes_per_s, flops / machine.peak_flops_per_s)


class StepTimeModel(Protocol):
    """Anything the placeholder runner can ask for a step's time (``StepModel``, ``ScaledStepModel``)."""

    def predict(self, f: StepFeatures) -> float: ...


@dataclass(frozen=True)
class ScaledStepModel:
    """The calibrated model's prediction, scaled by ``T_target / T_calibrated`` (see above)."""

    base: StepTimeModel
    source: ModelCost
    source_machine: Machine
    target: ModelCost
    target_machine: Machine

    def ratio(self, f: StepFeatures) -> float:
        return roofline_seconds(self.target, self.target_machine, f) / roofline_seconds(
            self.source, self.source_machine, f)

    def predict(self, f: StepFeatures) -> float:
        return self.base.predict(f) * self.ratio(f)
