"""Qwen3.5 hybrid decoder (Gated DeltaNet + gated full attention) for batched serving.

Layers follow ``layer_types``: ``linear_attention`` layers are Gated DeltaNets whose memory is a
fixed-size state per sequence (a short causal-conv window and a [heads, k_dim, v_dim] matrix),
kept in *state slots*; ``full_attention`` layers are softmax attention over the paged KV cache,
with QK-norm, partial RoPE and a sigmoid output gate. One forward takes the same flat batch as
Llama (decode tokens first, one per sequence, then prefill spans) with its ``AttentionMetadata``;
a span continues from its slot's state when ``context_len - num_tokens > 0`` (chunked prefill).

Maths (checked against the HF reference):

- Decoder norms, final norm and q/k norms are zero-centred RMSNorms: ``norm(x) * (1 + w)``,
  multiplied in float32 *before* the cast back (Llama casts first, then multiplies by ``w``).
- The DeltaNet output norm is a plain-weight RMSNorm over each value head, gated by ``silu(z)``.
- DeltaNet: q, k, v come from one projection through a depthwise causal conv (kernel 4) + SiLU;
  q and k are L2-normalised (and q scaled by k_dim^-1/2); per head and token a decay
  ``g = -exp(A_log) * softplus(a + dt_bias)`` and a write strength ``beta = sigmoid(b)``; the state
  update is ``S = exp(g) S + k (beta (v - (exp(g) S)^T k))^T`` and the output ``S^T q``. Value heads
  outnumber key heads; value head h reads key head ``h // (num_v / num_k)``.
- Full attention: ``q_proj`` yields per head [query | gate]; output ``o_proj(attn * sigmoid(gate))``.
  RoPE rotates only the first ``partial_rotary_factor * head_dim`` dims of each head. The M-RoPE
  sections of the multimodal models collapse to plain RoPE for text, where the temporal, height
  and width positions are all the token position.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenline.model.attention import AttentionMetadata, PrefillSpan, paged_attention
from tokenline.model.config import ModelConfig
from tokenline.model.layers import GatedMLP, Linear, apply_rotary, rope_inv_freq

LINEAR = "linear_attention"
FULL = "full_attention"
CHUNK_SIZE = 64  # tokens per chunk of the chunked delta rule: matmul-sized, and the triangular solve stays small

LinearState = tuple[torch.Tensor, torch.Tensor]  # (conv_state, recurrent_state) of one DeltaNet layer


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config, whether config.json is the text model's or the multimodal one's.

    In multimodal checkpoints the text fields sit under ``text_config``; top-level keys (such as
    ``tie_word_embeddings``) still apply where the text config does not say otherwise.
    """
    nested = raw.get("text_config")
    if not nested:
        return raw
    merged = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    merged.update(nested)
    return merged


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with weight ``1 + w`` (w initialised at 0), scaled in float32 before the cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``w * norm(x) * silu(gate)`` over the last dim: the DeltaNet's output norm (plain weight, not 1 + w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Same cast points as the reference: normalised x back to the model dtype, then the weight,
        # then the gate in float32.
        out = self.weight * x32.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


class PartialRotary:
    """RoPE over the first ``rotary_dim`` dims of each head; cos/sin computed per step from the positions.

    No cos/sin table and no buffers: nothing depends on the maximum model length, and building the
    model on the meta device leaves nothing uninitialised.
    """

    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.scaling = scaling
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions, [T, 1, rotary_dim], computed in float32 then cast."""
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq, scale = rope_inv_freq(self.rotary_dim, self.theta, self.scaling)
            if scale != 1.0:
                raise ValueError("rope scaling with an attention factor is not supported")
            inv_freq = self._inv_freq[positions.device] = inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rd = self.rotary_dim
        if rd == q.shape[-1]:
            return apply_rotary(q, k, cos_sin)
        q_rot, k_rot = apply_rotary(q[..., :rd], k[..., :rd], cos_sin)
        return torch.cat((q_rot, q[..., rd:]), dim=-1), torch.cat((k_rot, k[..., rd:]), dim=-1)


class Qwen3_5Attention(nn.Module):
    """Gated full attention: QK-norm per head, partial RoPE, ``sigmoid(gate)`` on the output."""

    def __init__(self, text: dict[str, Any], rotary: PartialRotary) -> None:
        super().__init__()
        hidden = text["hidden_size"]
        self.num_heads = text["num_attention_heads"]
        self.num_kv_heads = text.get("num_key_value_heads") or self.num_heads
        self.head_dim = text.get("head_dim") or hidden // self.num_heads
        self.output_gate = bool(text.get("attn_output_gate", True))
        eps = text.get("rms_norm_eps", 1e-6)
        bias = bool(text.get("attention_bias", False))
        # With the output gate, q_proj yields [query | gate] per head, twice the query width.
        self.q_width = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(hidden, self.q_width + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps)
        self.rotary = rotary

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_width, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(num_tokens, -1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary.apply(q, k, cos_sin)
        out = paged_attention(q, k, v, kv_cache, meta).flatten(1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule; its per-sequence memory lives in state slots."""

    def __init__(self, text: dict[str, Any]) -> None:
        super().__init__()
        hidden = text["hidden_size"]
        self.num_k_heads = text["linear_num_key_heads"]
        self.num_v_heads = text["linear_num_value_heads"]
        self.head_k_dim = text["linear_key_head_dim"]
        self.head_v_dim = text["linear_value_head_dim"]
        self.kernel = text.get("linear_conv_kernel_dim", 4)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # The four input projections (qkv, z, b, a) fused into one matmul.
        self.split_sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.in_proj = Linear(hidden, sum(self.split_sizes), bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.kernel))  # depthwise, no bias
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, text.get("rms_norm_eps", 1e-6))
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, state: LinearState, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.split_sizes, dim=-1)
        beta = b.float().sigmoid()
        # The decay in log space, in float32: exp(A_log) overflows float16 for large A.
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

        core = torch.empty(num_tokens, self.num_v_heads, self.head_v_dim, dtype=torch.float32, device=x.device)
        num_decode = meta.num_decode_tokens
        if num_decode:
            self._decode(mixed[:num_decode], g[:num_decode], beta[:num_decode], positions[:num_decode],
                         state, meta.decode_state_slots, core[:num_decode])
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.num_tokens)
            self._prefill(mixed[rows], g[rows], beta[rows], span, state, core[rows])

        # The reference casts the rule's output to the model dtype before the gated norm.
        out = self.norm(core.to(x.dtype), z.view(num_tokens, self.num_v_heads, self.head_v_dim))
        return self.out_proj(out.flatten(1))

    def _split_qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv activations [n, conv_dim] as q, k [n, num_k_heads, dk] and v [n, num_v_heads, dv]."""
        n = conv_out.shape[0]
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(n, self.num_k_heads, self.head_k_dim),
            k.reshape(n, self.num_k_heads, self.head_k_dim),
            v.reshape(n, self.num_v_heads, self.head_v_dim),
        )

    def _decode(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        positions: torch.Tensor,
        state: LinearState,
        slots: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """One token for each of D sequences: a conv step and a recurrent step, batched over sequences."""
        if slots is None:
            raise ValueError("decode tokens through a linear-attention layer need meta.decode_state_slots")
        conv_state, recurrent_state = state
        # A sequence at position 0 (a one-token prompt) starts from zero state, whatever its slot
        # held for an earlier request: the slot's previous contents are never trusted.
        fresh = (positions == 0)[:, None, None]
        window = torch.cat([conv_state.index_select(0, slots).masked_fill(fresh, 0), mixed.unsqueeze(-1)], dim=-1)
        conv_state.index_copy_(0, slots, window[:, :, 1:])
        conv_out = F.silu(F.conv1d(window.to(self.conv_weight.dtype), self.conv_weight, groups=self.conv_dim))
        q, k, v = self._split_qkv(conv_out.squeeze(-1).to(mixed.dtype))

        initial = recurrent_state.index_select(0, slots).masked_fill(fresh.unsqueeze(-1), 0)
        core, final = gated_delta_rule_recurrent(q, k, v, g, beta, initial)
        recurrent_state.index_copy_(0, slots, final)
        out.copy_(core)

    def _prefill(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        span: PrefillSpan,
        state: LinearState,
        out: torch.Tensor,
    ) -> None:
        """A span of one sequence: causal conv and the chunked rule, continuing from its slot's state."""
        conv_state, recurrent_state = state
        slot = span.state_slot
        continues = span.context_len > span.num_tokens  # earlier tokens are already folded into the slot
        history = self.kernel - 1
        if continues:
            previous = conv_state[slot]
        else:
            previous = mixed.new_zeros(self.conv_dim, history)
        sequence = torch.cat([previous, mixed.t()], dim=-1)  # [conv_dim, history + n]
        conv_state[slot] = sequence[:, -history:]
        conv_out = F.silu(F.conv1d(sequence.to(self.conv_weight.dtype).unsqueeze(0), self.conv_weight,
                                   groups=self.conv_dim))
        q, k, v = self._split_qkv(conv_out[0].t().to(mixed.dtype))

        initial = recurrent_state[slot] if continues else None
        core, final = gated_delta_rule_chunked(q, k, v, g, beta, initial)
        recurrent_state[slot] = final
        out.copy_(core)


# ---------------------------------------------------------------------------------------------
# The gated delta rule. Inputs per token: q, k [n, Hk, dk] (raw: normalised here), v [n, Hv, dv],
# g and beta [n, Hv] (float32); state [Hv, dk, dv] (one sequence) or [D, Hv, dk, dv] (decode).
# All maths in float32. On CUDA with flash-linear-attention installed its kernels run instead.


def _normalise_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised q and k in float32 (q also scaled by dk^-1/2), repeated to one per value head."""
    q, k = q.float(), k.float()
    # rsqrt(sum + eps) rather than F.normalize: the epsilon sits where the reference (and fla) put it.
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    groups = num_v_heads // q.shape[-2]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=-2)
        k = k.repeat_interleave(groups, dim=-2)
    return q, k


def gated_delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for D sequences: q, k [D, Hk, dk], v [D, Hv, dv], g, beta [D, Hv], state [D, Hv, dk, dv]."""
    fla = _fla_kernels() if q.is_cuda else None
    if fla is not None:
        return _fla_recurrent(fla, q, k, v, g, beta, state)
    q, k = _normalise_qk(q, k, v.shape[-2])
    v = v.float()
    state = state.float() * g.exp()[..., None, None]
    # What the decayed state already predicts for k; only the correction is written (the delta rule).
    predicted = torch.einsum("dhk,dhkv->dhv", k, state)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("dhk,dhkv->dhv", q, state), state


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over n tokens of one sequence, ``chunk_size`` tokens per matmul; returns (out [n, Hv, dv], state).

    Within a chunk with state S0 at its start and cumulative log-decay c_t (inclusive), the writes
    u_t = beta_t (v_t - exp(c_t) S0^T k_t - sum_{s<t} exp(c_t - c_s) (k_t . k_s) u_s) form a unit
    lower-triangular system (I + A) U = beta V - (beta exp(c) K) S0, solved once per chunk; then
    out = exp(c) Q S0 + (causal decayed Q K^T) U and S = exp(c_last) S0 + (exp(c_last - c) K)^T U.
    """
    fla = _fla_kernels() if q.is_cuda else None
    if fla is not None:
        return _fla_chunked(fla, q, k, v, g, beta, state)
    num_tokens, num_heads, dv = v.shape
    q, k = _normalise_qk(q, k, num_heads)
    dk = k.shape[-1]
    if state is None:
        state = v.new_zeros(num_heads, dk, dv, dtype=torch.float32)
    state = state.float()

    # [n, H, d] -> [H, chunks, C, d]; the tail is padded with beta = 0, g = 0: padded tokens write
    # nothing and do not decay, so the final state is the one after the last real token.
    pad = (-num_tokens) % chunk_size
    num_chunks = (num_tokens + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.float().transpose(0, 1), (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(num_heads, num_chunks, chunk_size, *x.shape[2:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # [H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # decay[t, s] = exp(c_t - c_s) for s <= t; masked before exp so that s > t cannot overflow.
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle is A
    # unitriangular=True reads only the strict lower triangle and takes the diagonal as 1: I + A.
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    state_keys = torch.linalg.solve_triangular(
        system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    out = torch.empty_like(v)
    for i in range(num_chunks):
        writes = values[:, i] - state_keys[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ writes
        state = state * chunk_decay[:, i] + k_decayed[:, i].transpose(-1, -2) @ writes
    out = out.reshape(num_heads, num_chunks * chunk_size, dv)[:, :num_tokens]
    return out.transpose(0, 1), state


@functools.cache
def _fla_kernels() -> tuple[Callable[..., Any], Callable[..., Any]] | None:  # (chunk, recurrent)
    """flash-linear-attention's (chunk, fused_recurrent) gated delta rule kernels, if installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _fla_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # fla takes one q/k head per value head here; it normalises and scales them itself.
    groups = v.shape[-2] // q.shape[-2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q, k


FlaKernels = tuple[Callable[..., Any], Callable[..., Any]]


def _fla_chunked(
    fla: FlaKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through fla's chunked kernel (a batch of one)."""
    q, k = _fla_inputs(q, k, v)
    initial = None if state is None else state.float().unsqueeze(0)
    out, final = fla[0](
        q[None], k[None], v[None], g[None], beta[None],
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out[0].float(), final[0]


def _fla_recurrent(
    fla: FlaKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """D decode tokens through fla's fused recurrent kernel, as D sequences of one token."""
    q, k = _fla_inputs(q, k, v)
    out, final = fla[1](
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
        initial_state=state.float(), output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    return out[:, 0].float(), final


# ---------------------------------------------------------------------------------------------


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, text: dict[str, Any], layer_type: str, rotary: PartialRotary) -> None:
        super().__init__()
        hidden, eps = text["hidden_size"], text.get("rms_norm_eps", 1e-6)
        self.layer_type = layer_type
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(text)
        elif layer_type == FULL:
            self.self_attn = Qwen3_5Attention(text, rotary)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, text["intermediate_size"])

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor | LinearState,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR:
            h = self.linear_attn(h, positions, cache, meta)
        else:
            h = self.self_attn(h, cos_sin, cache, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5ForCausalLM(nn.Module):
    """The Qwen3.5 text model. ``caches`` (from :meth:`make_caches`) hold one entry per layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        text = self.text = text_config(config.raw)
        hidden = text["hidden_size"]
        self.vocab_size = text["vocab_size"]
        self.layer_types: list[str] = list(text.get("layer_types") or _default_layer_types(text))
        self.tie_word_embeddings = bool(text.get("tie_word_embeddings", False))

        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", text.get("rope_theta", 10_000.0)))
        # 0.25 is what the reference assumes when a config does not say.
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        head_dim = text.get("head_dim") or hidden // text["num_attention_heads"]
        kind = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if kind == "default" else rope
        self.rotary = PartialRotary(int(head_dim * partial), theta, scaling)

        self.embed_tokens = nn.Embedding(self.vocab_size, hidden)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(text, t, self.rotary) for t in self.layer_types)
        self.norm = ZeroCenteredRMSNorm(hidden, text.get("rms_norm_eps", 1e-6))
        self.lm_head = Linear(hidden, self.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # -- caches --------------------------------------------------------------------------------

    def make_caches(
        self, num_blocks: int, block_size: int, num_state_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> list[torch.Tensor | LinearState]:
        """Per layer: a paged KV tensor (full attention) or (conv_state, recurrent_state) slots (DeltaNet).

        Zeros everywhere: padded decode rows read unused KV slots, and garbage there could be NaN.
        The recurrent state is float32 whatever the model dtype: it accumulates over the whole sequence.
        """
        caches: list[torch.Tensor | LinearState] = []
        for layer in self.layers:
            if layer.layer_type == FULL:
                attn = layer.self_attn
                shape = (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
                caches.append(torch.zeros(shape, dtype=dtype, device=device))
            else:
                net = layer.linear_attn
                conv = torch.zeros(num_state_slots, net.conv_dim, net.kernel - 1, dtype=dtype, device=device)
                recurrent = torch.zeros(
                    num_state_slots, net.num_v_heads, net.head_k_dim, net.head_v_dim,
                    dtype=torch.float32, device=device,
                )
                caches.append((conv, recurrent))
        return caches

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies across the full-attention layers."""
        return sum(
            2 * layer.self_attn.num_kv_heads * layer.self_attn.head_dim * dtype_size
            for layer in self.layers
            if layer.layer_type == FULL
        )

    def state_bytes_per_slot(self, dtype_size: int) -> int:
        """Bytes of one state slot across the DeltaNet layers (conv in the model dtype, recurrent in float32)."""
        total = 0
        for layer in self.layers:
            if layer.layer_type == LINEAR:
                net = layer.linear_attn
                total += net.conv_dim * (net.kernel - 1) * dtype_size
                total += net.num_v_heads * net.head_k_dim * net.head_v_dim * 4
        return total

    # -- forward -------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor | LinearState],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, positions, cos_sin, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # -- weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (text-only or multimodal checkpoints), fusing projections as they arrive."""
        # Re-tie here: building on the meta device and ``to_empty`` unties shared parameters.
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        fused = self._fused_pieces()
        loaded: set[str] = set()
        for name, tensor in weights:
            name = _text_name(name)
            if name is None or name.startswith("rotary_emb."):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            target, offset = name, 0
            for piece, (ours, row) in fused.items():
                if piece in name:
                    target, offset = name.replace(piece, ours), row
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if param.dim() != tensor.dim() or param.shape[1:] != tensor.shape[1:]:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected rows of {tuple(param.shape)}")
            with torch.no_grad():
                param.narrow(0, offset, tensor.shape[0]).copy_(tensor)
            loaded.add(f"{target}@{offset}")

        if not self.tie_word_embeddings and "lm_head.weight@0" not in loaded and "embed_tokens.weight@0" in loaded:
            # Some multimodal configs state tying only at the top level; no lm_head in the file means tied.
            self.tie_word_embeddings = True
            self.lm_head.weight = self.embed_tokens.weight
        missing = self._expected_pieces(fused) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")

    def _fused_pieces(self) -> dict[str, tuple[str, int]]:
        """HF name piece -> (our name piece, first row inside our fused parameter)."""
        text = self.text
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        heads = text["num_attention_heads"]
        kv_heads = text.get("num_key_value_heads") or heads
        q_width = heads * head_dim * (2 if text.get("attn_output_gate", True) else 1)
        key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
        value_dim = text["linear_num_value_heads"] * text["linear_value_head_dim"]
        conv_dim = 2 * key_dim + value_dim
        v_heads = text["linear_num_value_heads"]
        return {
            "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
            "self_attn.k_proj.": ("self_attn.qkv_proj.", q_width),
            "self_attn.v_proj.": ("self_attn.qkv_proj.", q_width + kv_heads * head_dim),
            "linear_attn.in_proj_qkv.": ("linear_attn.in_proj.", 0),
            "linear_attn.in_proj_z.": ("linear_attn.in_proj.", conv_dim),
            "linear_attn.in_proj_b.": ("linear_attn.in_proj.", conv_dim + value_dim),
            "linear_attn.in_proj_a.": ("linear_attn.in_proj.", conv_dim + value_dim + v_heads),
            "linear_attn.conv1d.weight": ("linear_attn.conv_weight", 0),
            "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
            "mlp.up_proj.": ("mlp.gate_up_proj.", text["intermediate_size"]),
        }

    def _expected_pieces(self, fused: dict[str, tuple[str, int]]) -> set[str]:
        offsets: dict[str, set[int]] = {}
        for ours, row in fused.values():
            offsets.setdefault(ours, set()).add(row)
        pieces: set[str] = set()
        for name, _ in self.named_parameters():  # a tied lm_head is not listed: it is embed_tokens
            rows = next((rows for ours, rows in offsets.items() if ours in name), {0})
            pieces |= {f"{name}@{row}" for row in rows}
        return pieces


def _text_name(name: str) -> str | None:
    """An HF weight name relative to the text model, or None for weights we do not use."""
    if name.startswith("model.language_model."):
        return name.removeprefix("model.language_model.")
    if name.startswith(("model.visual.", "visual.", "mtp.")):
        return None  # the vision tower and the multi-token-prediction head: not part of text decoding
    return name.removeprefix("model.")


def _default_layer_types(text: dict[str, Any]) -> list[str]:
    """Every ``full_attention_interval``-th layer is full attention, the others linear (the reference default)."""
    interval = text.get("full_attention_interval", 4)
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(text["num_hidden_layers"])]
