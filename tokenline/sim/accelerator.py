"""A GPU's step time from its published figures alone: the accelerator step model.

For a step with features f (prefill tokens P, decode sequences D, attended context tokens C, prefill
query-key pairs Q; N = P + D tokens, S = sequences sampled) of a model split over ``tp`` GPUs:

    linears   = max(body bytes / (bw · η_bw),  2 · N · body params / (peak · η_mm)) / tp
    lm head   = max(head bytes / (bw · η_bw),  2 · S · head params / (peak · η_mm)) / tp
    attention = (C · KV bytes per token + 2 · D · state bytes) / (bw · η_bw) / tp
                + 4 · (C + Q) · heads · head_dim · full-attention layers / (peak · η_attn) / tp
    comm      = layers · 2 · (all-reduce latency + 2 · (tp − 1)/tp · N · hidden · 2 B / link)   (tp > 1)
    step      = step overhead + layers · layer overhead · kernels/10 + linears + lm head + attention + comm

(on a sliding-window model C and Q are averaged over the attention layers, each sliding layer's
counted at its window: ``ModelCost.attended``). bw, peak and link are the datasheet's (``machines/*.json``); η are achieved fractions and the
overheads fixed costs, one set for every GPU, taken from published measurements (docs/operate/planner.md):
nothing here reads this machine's calibration, so a GPU prediction does not move when this CPU is
calibrated again. The LM head runs on the sampled rows only (vLLM computes logits for the last
token of a prefill), which matters for large vocabularies (Gemma 3: 262k).

Limits: one efficiency per kind of work whatever the shapes (small GEMMs at batch 2-16 reach less);
no quantization of weights or KV (bf16 throughout); pipeline parallelism and expert parallelism are
not modelled; the all-reduce is a ring over the stated link bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.model.config import ModelConfig
from tokenline.sim.machine import Machine
from tokenline.sim.roofline_scaling import ModelCost, model_cost
from tokenline.sim.step_model import StepFeatures

# Kernels one decoder layer launches in vLLM's decode step. The machine table's layer overhead is a
# Llama layer's ten (add-norm, qkv, rotary, cache write, attention, o_proj, add-norm, gate_up,
# act-and-mul, down); q/k norms add two, Gemma 3's post-attention and post-feedforward norms two more.
LLAMA_LAYER_KERNELS = 10
LAYER_KERNELS = {
    "Qwen3ForCausalLM": 12,
    "Qwen3MoeForCausalLM": 12,
    "Gemma3ForCausalLM": 14,
    "Gemma3ForConditionalGeneration": 14,
}
ALL_REDUCE_LATENCY_S = 10e-6  # one small NCCL all-reduce within a node (NVLink); PCIe pays it in bandwidth
ACTIVATION_BYTES = 2  # bf16 activations in the all-reduces


@dataclass(frozen=True)
class AcceleratorCost:
    """What the accelerator model needs of a model beyond ``ModelCost``."""

    cost: ModelCost
    head_params: int  # the LM head (vocab × hidden), run on sampled rows only
    hidden_size: int
    layer_kernels: int = LLAMA_LAYER_KERNELS  # per decoder layer (``LAYER_KERNELS``)

    @property
    def body_params(self) -> int:
        return self.cost.matmul_params - self.head_params


def accelerator_cost(config: ModelConfig, dtype_size: int = 2) -> AcceleratorCost:
    """Hybrid layers (Gated DeltaNet) and architectures not in ``LAYER_KERNELS`` count as a Llama layer."""
    return AcceleratorCost(model_cost(config, dtype_size), config.vocab_size * config.hidden_size, config.hidden_size,
                           LAYER_KERNELS.get(config.architecture, LLAMA_LAYER_KERNELS))


@dataclass(frozen=True)
class AcceleratorStepModel:
    """``predict(f)``: one step's seconds on ``tp`` of ``machine`` (formula above)."""

    model: AcceleratorCost
    machine: Machine
    tp: int = 1

    def __post_init__(self) -> None:
        if not self.machine.is_accelerator:
            raise ValueError(f"{self.machine.name} has no achieved fractions: it is not an accelerator table entry")
        if self.tp < 1:
            raise ValueError("tensor-parallel degree must be >= 1")

    def parts(self, f: StepFeatures) -> dict[str, float]:
        m, c = self.machine, self.model.cost
        bw = m.bandwidth_bytes_per_s * (m.bandwidth_efficiency or 1.0)
        mm = m.peak_flops_per_s * (m.matmul_efficiency or 1.0)
        attn = m.peak_flops_per_s * (m.attention_efficiency or 1.0)
        size = c.weight_bytes / max(c.num_parameters, 1)  # bytes per parameter
        tokens = f.prefill_tokens + f.decode_seqs
        sampled = f.decode_seqs + (1 if f.prefill_tokens else 0)  # a step's prefill chunks end in ~one sample
        body = self.model.body_params
        head = self.model.head_params
        context, pairs = c.attended(f)  # sliding-window layers read their window only
        parts = {
            "fixed": (m.step_overhead_ms or 0.0) / 1e3
            + c.num_layers * m.layer_overhead_us / 1e6 * self.model.layer_kernels / LLAMA_LAYER_KERNELS,
            "linears": max(body * size / bw, 2 * tokens * body / mm) / self.tp,
            "lm_head": max(head * size / bw, 2 * sampled * head / mm) / self.tp if sampled else 0.0,
            "attention": ((context * c.kv_bytes_per_token + 2 * f.decode_seqs * c.state_bytes_per_sequence) / bw
                          + (context + pairs) * c.attention_flops_per_context_token / attn) / self.tp,
            "comm": 0.0,
        }
        if self.tp > 1:
            link = (m.interconnect_gbps or 32.0) * 1e9
            ring = 2 * (self.tp - 1) / self.tp * tokens * self.model.hidden_size * ACTIVATION_BYTES / link
            parts["comm"] = c.num_layers * 2 * (ALL_REDUCE_LATENCY_S + ring)
        return parts

    def predict(self, f: StepFeatures) -> float:
        return sum(self.parts(f).values())
