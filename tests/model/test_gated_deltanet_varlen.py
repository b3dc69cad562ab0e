"""Several sequences through the gated delta rule in one batched call: the same outputs, final
states and mid-sequence states as each sequence through the single-sequence chunked form."""

from __future__ import annotations

import torch

from tokenline.model.gated_deltanet import gated_delta_rule_chunked, gated_delta_rule_chunked_varlen


def test_varlen_matches_one_sequence_at_a_time() -> None:
    gen = torch.Generator().manual_seed(11)
    hk, hv, dk, dv = 2, 4, 16, 8
    # Three sequences: one segment, a segment boundary off the chunk grid, a fresh (zero) start.
    segments = [[37], [20, 9, 14], [5]]
    lengths = [sum(s) for s in segments]
    total = sum(lengths)
    q, k = torch.randn(total, hk, dk, generator=gen), torch.randn(total, hk, dk, generator=gen)
    v = torch.randn(total, hv, dv, generator=gen)
    g = -torch.rand(total, hv, generator=gen) * 3
    beta = torch.rand(total, hv, generator=gen)
    initial = torch.randn(3, hv, dk, dv, generator=gen)
    initial[2] = 0
    for chunk_size in (8, 64):
        out, final, mids = gated_delta_rule_chunked_varlen(q, k, v, g, beta, segments, initial, chunk_size)
        start = 0
        for b, seq in enumerate(segments):
            rows = slice(start, start + lengths[b])
            want, want_final = gated_delta_rule_chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], initial[b],
                                                        chunk_size=chunk_size)
            torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(final[b], want_final, atol=1e-5, rtol=1e-5)
            done = start
            for n, mid in zip(seq, mids[b], strict=False):
                done += n
                _, want_mid = gated_delta_rule_chunked(q[start:done], k[start:done], v[start:done], g[start:done],
                                                       beta[start:done], initial[b], chunk_size=chunk_size)
                torch.testing.assert_close(mid, want_mid, atol=1e-5, rtol=1e-5)
            assert len(mids[b]) == len(seq) - 1
            start += lengths[b]
