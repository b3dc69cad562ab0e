"""The Gated DeltaNet: linear attention with the gated delta rule (Qwen3.5's linear-attention layers).

Its memory is a fixed-size state per sequence, kept in *state slots*: a short causal-conv window
and a [heads, k_dim, v_dim] matrix. q, k, v come from one projection through a depthwise causal
conv (kernel 4) + SiLU; q and k are L2-normalised (and q scaled by k_dim^-1/2); per head and token
a decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and a write strength ``beta = sigmoid(b)``; the
state update is ``S = exp(g) S + k (beta (v - (exp(g) S)^T k))^T`` and the output ``S^T q``. Value
heads outnumber key heads; value head h reads key head ``h // (num_v / num_k)``. The output goes
through a plain-weight RMSNorm over each value head, gated by ``silu(z)``. A prefill span continues
from its slot's state when ``context_len - num_tokens > 0`` (chunked prefill). A span may also ask for
the state after some of its tokens (``PrefillSpan.checkpoints``, the engine's prefix-cache
checkpoints): the chunked rule runs segment by segment up to each, and the conv window there is a
slice of the span's input; so a checkpoint never needs a scheduler chunk to end at it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenline.model.attention import AttentionMetadata
from tokenline.model.config import ModelConfig
from tokenline.model.layers import GatedRMSNorm, Linear, MergedLinear
from tokenline.model.prefill_attention import PrefillSpan

CHUNK_SIZE = 64  # tokens per chunk of the chunked delta rule: matmul-sized, and the triangular solve stays small
# Several sequences' prefill spans run as one batched, padded chunked rule only while a layer's
# state is this small (value heads x dk x dv): there per-call overhead dominates and batching won
# 1.4-2.2x on CPU; at Qwen3.5-27B's 786,432 the padding and layout copies lost 13-40 %
# (bench/hybrid_batched_prefill.py).
BATCHED_PREFILL_MAX_STATE = 65_536

LinearState = tuple[torch.Tensor, torch.Tensor]  # (conv_state, recurrent_state) of one DeltaNet layer


@dataclass(frozen=True)
class DeltaNetShape:
    """The sizes of one Gated DeltaNet layer, read from the config's ``linear_*`` keys."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    kernel: int  # the causal conv's width

    @classmethod
    def from_config(cls, config: ModelConfig) -> DeltaNetShape:
        raw = config.raw
        shape = cls(
            num_k_heads=raw["linear_num_key_heads"],
            num_v_heads=raw["linear_num_value_heads"],
            head_k_dim=raw["linear_key_head_dim"],
            head_v_dim=raw["linear_value_head_dim"],
            kernel=raw.get("linear_conv_kernel_dim", 4),
        )
        if shape.num_v_heads % shape.num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        return shape

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, dtype_size: int) -> int:
        """One slot: the conv window (activation dtype) plus the delta-rule state (float32)."""
        return self.conv_dim * (self.kernel - 1) * dtype_size + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4


class GatedDeltaNet(nn.Module):
    """Linear attention with the gated delta rule; its per-sequence memory lives in state slots."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        shape = self.shape = DeltaNetShape.from_config(config)
        self.num_k_heads, self.num_v_heads = shape.num_k_heads, shape.num_v_heads
        self.head_k_dim, self.head_v_dim = shape.head_k_dim, shape.head_v_dim
        self.kernel = shape.kernel
        self.key_dim, self.value_dim, self.conv_dim = shape.key_dim, shape.value_dim, shape.conv_dim
        # The four input projections (qkv, z, b, a) fused into one matmul.
        self.split_sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.in_proj = MergedLinear(config.hidden_size, self.split_sizes, bias=False)
        # Depthwise, no bias; only its weight is used (by F.conv1d over the slot's window).
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, config.hidden_size, bias=False)

    def make_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> LinearState:
        """Zeroed (conv window, recurrent state) slots. The recurrent state is float32 whatever the
        model dtype: it accumulates over the whole sequence."""
        conv = torch.zeros(num_slots, self.conv_dim, self.kernel - 1, dtype=dtype, device=device)
        recurrent = torch.zeros(
            num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32, device=device
        )
        return conv, recurrent

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
        spans = [span for span in meta.prefills if not span.drafts]
        with_drafts = [span for span in meta.prefills if span.drafts]
        if with_drafts:
            meta.pending_states.append(self._verify(mixed, g, beta, with_drafts, state, core))
        small = self.num_v_heads * self.head_k_dim * self.head_v_dim <= BATCHED_PREFILL_MAX_STATE
        if len(spans) > 1 and small and not (x.is_cuda and _fla_kernels() is not None):
            self._prefill_batched(mixed, g, beta, spans, state, core)
        else:
            for span in spans:
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
        # One output a channel: the window's dot product with its filter, in float32. F.conv1d's
        # depthwise path (oneDNN) cost ~100x more than this product for [D, conv_dim, kernel].
        conv_out = F.silu((window.float() * self.conv1d.weight[:, 0, :].float()).sum(-1))
        q, k, v = self._split_qkv(conv_out.to(mixed.dtype))

        # Advanced indexing, not index_select / index_copy_: on CPU (torch 2.13) those take ~100x longer
        # on rows this large (a 1 MiB state a sequence), which made them most of the decode step.
        initial = recurrent_state[slots]  # a copy: zeroed in place, only when needed
        if bool(fresh.any()):
            initial.masked_fill_(fresh.unsqueeze(-1), 0)
        core, final = gated_delta_rule_recurrent(q, k, v, g, beta, initial)
        recurrent_state[slots] = final
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
        conv_out = F.silu(F.conv1d(sequence.to(self.conv1d.weight.dtype).unsqueeze(0), self.conv1d.weight,
                                   groups=self.conv_dim))
        q, k, v = self._split_qkv(conv_out[0].t().to(mixed.dtype))

        initial = recurrent_state[slot] if continues else None
        if not span.checkpoints:
            core, final = gated_delta_rule_chunked(q, k, v, g, beta, initial)
            recurrent_state[slot] = final
            out.copy_(core)
            return
        # The window after `offset` tokens is the `history` inputs before it: columns offset ..
        # offset + history of `sequence` (which starts with the window carried in).
        done = 0
        for offset, checkpoint in span.checkpoints:
            rows = slice(done, offset)
            core, initial = gated_delta_rule_chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], initial)
            out[rows].copy_(core)
            recurrent_state[checkpoint] = initial
            conv_state[checkpoint] = sequence[:, offset : offset + history]
            done = offset
        core, final = gated_delta_rule_chunked(q[done:], k[done:], v[done:], g[done:], beta[done:], initial)
        recurrent_state[slot] = final
        out[done:].copy_(core)

    def _conv_windows(
        self, mixed: torch.Tensor, spans: list[PrefillSpan], conv_state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each span's conv window, padded to the longest span: the slot's saved history when the
        span continues its sequence (else zeros), then its tokens; and the activated conv output
        [spans, conv_dim, longest] over those windows in one call."""
        history = self.kernel - 1
        longest = max(span.num_tokens for span in spans)
        windows = mixed.new_zeros(len(spans), self.conv_dim, history + longest)
        for b, span in enumerate(spans):
            if span.context_len > span.num_tokens:
                windows[b, :, :history] = conv_state[span.state_slot]
            windows[b, :, history : history + span.num_tokens] = mixed[span.start : span.start + span.num_tokens].t()
        conv_out = F.silu(F.conv1d(windows.to(self.conv1d.weight.dtype), self.conv1d.weight, groups=self.conv_dim))
        return windows, conv_out

    def _prefill_batched(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        spans: list[PrefillSpan],
        state: LinearState,
        core: torch.Tensor,
    ) -> None:
        """Several sequences' spans in one conv call and one batched chunked rule (padded to the
        longest), rather than one after another: the same maths as :meth:`_prefill` per span."""
        conv_state, recurrent_state = state
        history = self.kernel - 1
        windows, conv_out = self._conv_windows(mixed, spans, conv_state)
        initial = [recurrent_state[s.state_slot] if s.context_len > s.num_tokens else None for s in spans]
        for b, span in enumerate(spans):
            n = span.num_tokens
            conv_state[span.state_slot] = windows[b, :, n : n + history]
            for offset, checkpoint in span.checkpoints:
                conv_state[checkpoint] = windows[b, :, offset : offset + history]

        rows = [torch.arange(s.start, s.start + s.num_tokens, device=mixed.device) for s in spans]
        flat = torch.cat(rows)
        acts = torch.cat([conv_out[b, :, : s.num_tokens].t() for b, s in enumerate(spans)]).to(mixed.dtype)
        q, k, v = self._split_qkv(acts)
        zero = recurrent_state.new_zeros(recurrent_state.shape[1:])
        start = torch.stack([zero if state is None else state for state in initial])
        segments = []
        for span in spans:
            bounds = [0, *(offset for offset, _ in span.checkpoints), span.num_tokens]
            segments.append([b - a for a, b in zip(bounds, bounds[1:])])
        out, final, snapshots = gated_delta_rule_chunked_varlen(
            q, k, v, g.index_select(0, flat), beta.index_select(0, flat), segments, start
        )
        for b, span in enumerate(spans):
            recurrent_state[span.state_slot] = final[b]
            for (_, checkpoint), snapshot in zip(span.checkpoints, snapshots[b], strict=True):
                recurrent_state[checkpoint] = snapshot
        core.index_copy_(0, flat, out)

    def _verify(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        spans: list[PrefillSpan],
        state: LinearState,
        core: torch.Tensor,
    ) -> PendingStates:
        """Spans that end with draft tokens (a last known token + k drafts each), batched as one
        chunk of the rule padded to the longest. Their slots are left as they were: the returned
        record writes the state after the accepted tokens once sampling has decided (rollback).

        Why this shape (bench/hybrid_spec_rollback.py): a chunk's state after any prefix of its
        tokens is exp(c_t) S0 + (decayed K[:t])^T U[:t], from the same writes U the chunk computes
        anyway. So keeping the per-token writes (k+1 rows of [heads, dv]) and forming only the
        accepted state later costs one state-sized update, as the plain step's final state does;
        keeping k+1 full states (the recurrent form per position) writes k+1 states per layer, and
        snapshot-then-recompute runs the accepted tokens through the rule a second time. Measured
        (CPU ms per layer and step, k = 4, one thread, loaded machine, two runs): Qwen3.5-27B's
        shape, 8 sequences: writes 44-100, k+1 states 237-284, recompute 352-401 (and 131-178 for
        the old chunked rule per span with no rollback: a 64-token chunk for 5 tokens); 1 sequence:
        6.4-6.6 / 18-21 / 26-35 (16-25).
        """
        conv_state, recurrent_state = state
        longest = max(span.num_tokens for span in spans)
        batch = len(spans)
        windows, conv_out = self._conv_windows(mixed, spans, conv_state)
        initial = recurrent_state.new_zeros(batch, *recurrent_state.shape[1:])
        g_rows = g.new_zeros(batch, longest, self.num_v_heads)
        beta_rows = beta.new_zeros(batch, longest, self.num_v_heads)
        for b, span in enumerate(spans):
            rows = slice(span.start, span.start + span.num_tokens)
            if span.context_len > span.num_tokens:  # else a one-token prompt: zero state
                initial[b] = recurrent_state[span.state_slot]
            g_rows[b, : span.num_tokens] = g[rows]
            beta_rows[b, : span.num_tokens] = beta[rows]
        acts = conv_out.transpose(1, 2).to(mixed.dtype)  # [B, longest, conv_dim]
        q, k, v = self._split_qkv(acts.reshape(batch * longest, self.conv_dim))
        shape = (batch, longest)
        out, writes = gated_delta_rule_with_writes(
            q.reshape(*shape, *q.shape[1:]), k.reshape(*shape, *k.shape[1:]), v.reshape(*shape, *v.shape[1:]),
            g_rows, beta_rows, initial,
        )
        for b, span in enumerate(spans):
            core[span.start : span.start + span.num_tokens] = out[b, : span.num_tokens]
        pending = PendingStates(state, [span.state_slot for span in spans], windows, writes)
        # Prefix-cache checkpoints inside such a span sit before its drafts (the scheduler plans
        # them up to the last known token), so they are taken now, never holding a draft.
        saves = [(b, offset, slot) for b, span in enumerate(spans) for offset, slot in span.checkpoints]
        if saves:
            pending.write([b for b, _, _ in saves], [slot for _, _, slot in saves], [n for _, n, _ in saves])
        return pending


def copy_state_slots(state: LinearState, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy one layer's (conv window, recurrent state) from slots ``src`` to slots ``dst``."""
    for tensor in state:
        tensor[dst] = tensor[src]  # not index_copy_ / index_select: slow on CPU for large rows (see _decode)


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
    d, h, dk, dv = state.shape
    # The state is the step's big operand (Hv x dk x dv floats a sequence): one new tensor for the
    # decayed state, then updated in place and read through bmm, rather than a temporary per term.
    state = state.float() * g.exp()[..., None, None]
    flat = state.view(d * h, dk, dv)
    # What the decayed state already predicts for k; only the correction is written (the delta rule).
    predicted = torch.bmm(k.reshape(d * h, 1, dk), flat).view(d, h, dv)
    delta = (v - predicted) * beta[..., None]
    flat.baddbmm_(k.reshape(d * h, dk, 1), delta.reshape(d * h, 1, dv))
    return torch.bmm(q.reshape(d * h, 1, dk), flat).view(d, h, dv), state


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
    out, state, _ = _chunked_rule(q, k, v, g, beta, state)
    out = out.reshape(num_heads, num_chunks * chunk_size, dv)[:, :num_tokens]
    return out.transpose(0, 1), state


def _chunked_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    snapshots: frozenset[int] = frozenset(),
) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """The chunked rule on normalised float32 inputs laid out [..., H, N, C, d] (g, beta [..., H, N, C])
    from ``state`` [..., H, dk, dv]; returns (out [..., H, N, C, dv], final state, the state after
    each chunk index in ``snapshots``)."""
    num_chunks = g.shape[-2]
    cum, values, state_keys, scores, q_decayed = _chunk_terms(q, k, v, g, beta)
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [..., H, N, 1, 1]

    out = torch.empty_like(v)
    taken = {}
    for i in range(num_chunks):
        writes = values[..., i, :, :] - state_keys[..., i, :, :] @ state
        out[..., i, :, :] = q_decayed[..., i, :, :] @ state + scores[..., i, :, :] @ writes
        state = state * chunk_decay[..., i, :, :] + k_decayed[..., i, :, :].transpose(-1, -2) @ writes
        if i in snapshots:
            taken[i] = state
    return out, state, taken


def _chunk_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The state-independent terms of the chunked rule, per chunk (inputs [..., C, d], g, beta
    [..., C]): the cumulative log-decay c, the solved (I + A)^-1 beta V and (I + A)^-1 beta exp(c) K
    (so a chunk's writes from state S0 are ``values - state_keys @ S0``), the causal decayed
    Q K^T and exp(c) Q."""
    chunk_size = g.shape[-1]
    cum = g.cumsum(-1)  # [..., C]
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
    return cum, values, state_keys, scores, q * cum.exp()[..., None]


def gated_delta_rule_chunked_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    segments: list[list[int]],
    initial: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """The rule over several sequences in one batched computation (their spans of one step).

    Rows of q, k, v, g, beta hold the sequences one after another; sequence b has
    ``sum(segments[b])`` rows and starts from ``initial[b]`` [Hv, dk, dv]. Each segment is padded
    to whole chunks (beta = 0, g = 0: padding writes nothing and does not decay), so the state at
    every segment's end is a chunk's end state, and a sequence with fewer chunks than the longest
    keeps its final state through the padding. Returns (out [rows, Hv, dv], final states [B, Hv,
    dk, dv], per sequence the states at the ends of all but its last segment).
    """
    num_rows, num_heads, dv = v.shape
    q, k = _normalise_qk(q, k, num_heads)
    dk = k.shape[-1]
    # Where each real row goes in the padded [B, N * C] layout, and which chunk ends each segment.
    chunks = [sum(-(-n // chunk_size) for n in seq) for seq in segments]
    width = max(chunks) * chunk_size
    index: list[int] = []
    ends: list[list[int]] = []
    for b, seq in enumerate(segments):
        position = b * width
        seq_ends = []
        for n in seq:
            index.extend(range(position, position + n))
            position += -(-n // chunk_size) * chunk_size
            seq_ends.append((position - b * width) // chunk_size - 1)
        ends.append(seq_ends[:-1])
    if len(index) != num_rows:
        raise ValueError(f"segments cover {len(index)} rows, the inputs have {num_rows}")
    rows = torch.tensor(index, dtype=torch.long, device=q.device)
    batch = len(segments)

    def padded(x: torch.Tensor) -> torch.Tensor:
        flat = x.new_zeros(batch * width, *x.shape[1:], dtype=torch.float32)
        flat.index_copy_(0, rows, x.float())
        # [B * N * C, H, (d)] -> [B, H, N, C, (d)]
        x = flat.view(batch, width, *x.shape[1:]).transpose(1, 2)
        return x.reshape(batch, num_heads, width // chunk_size, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (padded(x) for x in (q, k, v, g, beta))
    wanted = frozenset(i for seq_ends in ends for i in seq_ends)
    out, final, taken = _chunked_rule(q, k, v, g, beta, initial.float(), wanted)
    out = out.reshape(batch, num_heads, width, dv).transpose(1, 2).reshape(batch * width, num_heads, dv)
    states = [[taken[i][b] for i in seq_ends] for b, seq_ends in enumerate(ends)]
    return out.index_select(0, rows), final, states


@dataclass
class DeltaWrites:
    """What one chunk of the rule wrote, per sequence b and token t (all float32): the state it
    started from, the normalised keys, the writes u_t and the cumulative log-decay c_t. The state
    after the first n tokens is exp(c_{n-1}) S0 + sum_{t<n} exp(c_{n-1} - c_t) k_t u_t^T."""

    initial: torch.Tensor  # [B, Hv, dk, dv]
    keys: torch.Tensor  # [B, Hv, L, dk]
    writes: torch.Tensor  # [B, Hv, L, dv]
    cum: torch.Tensor  # [B, Hv, L]

    def states_after(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The state of sequence ``rows[i]`` after its first ``counts[i]`` (>= 1) tokens: [len(rows), Hv, dk, dv]."""
        cum = self.cum.index_select(0, rows)  # [R, Hv, L]
        last = cum.gather(-1, (counts - 1)[:, None, None].expand(-1, cum.shape[1], 1))  # [R, Hv, 1]
        kept = torch.arange(cum.shape[-1], device=cum.device)[None, None, :] < counts[:, None, None]
        # Masked before exp: past the kept tokens c_{n-1} - c_t is positive and could overflow.
        weights = (last - cum).masked_fill(~kept, float("-inf")).exp()
        keys = self.keys.index_select(0, rows) * weights[..., None]
        return (self.initial.index_select(0, rows) * last.exp()[..., None]
                + keys.transpose(-1, -2) @ self.writes.index_select(0, rows))


def gated_delta_rule_with_writes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial: torch.Tensor
) -> tuple[torch.Tensor, DeltaWrites]:
    """The rule over B short spans as one chunk each (q, k [B, L, Hk, dk], v [B, L, Hv, dv], g, beta
    [B, L, Hv], initial [B, Hv, dk, dv]; padding rows have g = beta = 0 and write nothing). Returns
    out [B, L, Hv, dv] and the writes, from which :meth:`DeltaWrites.states_after` forms the state
    after any prefix; no final state is written."""
    num_heads = v.shape[-2]
    q, k = _normalise_qk(q, k, num_heads)
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))  # [B, Hv, L, d]
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))  # [B, Hv, L]
    initial = initial.float()
    cum, values, state_keys, scores, q_decayed = _chunk_terms(q, k, v, g, beta)
    writes = values - state_keys @ initial
    out = q_decayed @ initial + scores @ writes
    return out.transpose(1, 2), DeltaWrites(initial, k, writes, cum)


@dataclass
class PendingStates:
    """One linear layer's spans with drafts in a step, their slots still holding the state from
    before it: :meth:`commit` writes each slot's state after the tokens it keeps (the rollback of
    rejected drafts). Made by ``GatedDeltaNet._verify``, committed by the runner after sampling."""

    state: LinearState
    slots: list[int]
    windows: torch.Tensor  # [B, conv_dim, kernel - 1 + L]: the window carried in, then each token's input
    writes: DeltaWrites

    def commit(self, kept: dict[int, int]) -> None:
        """``kept``: slot -> tokens of its span now computed for good (1 + accepted drafts)."""
        self.write(list(range(len(self.slots))), self.slots, [kept[slot] for slot in self.slots])

    def write(self, rows: list[int], slots: list[int], counts: list[int]) -> None:
        """Into ``slots[i]``: the state (conv window and recurrent) of span ``rows[i]`` after ``counts[i]`` tokens."""
        device = self.windows.device
        rows_t, slots_t, counts_t = (torch.tensor(x, dtype=torch.long, device=device) for x in (rows, slots, counts))
        conv_state, recurrent_state = self.state
        history = conv_state.shape[-1]
        # The conv window after n tokens is the `history` inputs before it: columns n .. n + history.
        columns = counts_t[:, None] + torch.arange(history, device=device)[None, :]
        windows = self.windows.index_select(0, rows_t)
        windows = windows.gather(2, columns[:, None, :].expand(-1, windows.shape[1], -1))
        conv_state.index_copy_(0, slots_t, windows.to(conv_state.dtype))
        recurrent_state[slots_t] = self.writes.states_after(rows_t, counts_t)  # not index_copy_ (see _decode)


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

