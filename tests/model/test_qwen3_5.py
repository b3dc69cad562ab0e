"""Qwen3.5 hybrid vs the transformers reference on a tiny random model, through our paged/slot caches.

Every step's metadata is built by hand (as the runner would) so that each path is exercised on its
own: prefill spans from zero state, batched decode through the recurrent step, chunked prefill
that continues from a slot's state, and a one-token prompt in a slot left dirty by an earlier
request. The reference is always HF's full-sequence forward over the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TinyQwen3_5
from tokenline.model.attention import AttentionMetadata
from tokenline.model.prefill_attention import PrefillSpan
from tokenline.model.config import ModelConfig
from tokenline.model.gated_deltanet import gated_delta_rule_chunked, gated_delta_rule_recurrent
from tokenline.model.qwen3_5 import Qwen3_5ForCausalLM
from tokenline.model.random_models import QWEN3_5_VOCAB_SIZE
from tokenline.model.sampler import Sampler, SamplingMetadata, SamplingRow
from tokenline.model.weights import iter_safetensors, load_packed_weights
from tokenline.sampling_params import SamplingParams

BLOCK_SIZE = 4  # small, so that every sequence spans several blocks
NUM_BLOCKS = 256
NUM_SLOTS = 6
ATOL = 1e-4
TOKENIZER_VOCAB = 248_077  # the Qwen3.5 tokenizer's ids; the rest of the 248,320 rows are padding


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_5: TinyQwen3_5) -> Path:
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    from transformers import Qwen3_5ForCausalLM as HFQwen3_5ForCausalLM

    return HFQwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Qwen3_5ForCausalLM:
    ours = Qwen3_5ForCausalLM(ModelConfig.from_dir(model_dir))
    load_packed_weights(ours, iter_safetensors(model_dir))
    return ours.to(torch.float32).eval()


def hf_logits(reference: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([token_ids])).logits[0]


@dataclass
class Seq:
    """What the engine would know of one sequence: its tokens, blocks and state slot."""

    token_ids: list[int]
    slot: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens already run through the model


class Step:
    """Builds one step's flat batch and metadata, laid out like the runner does (decode rows first)."""

    def __init__(self) -> None:
        self.next_block = 1  # block 0 stays free: padded decode tables point at it

    def run(self, model: Qwen3_5ForCausalLM, caches: list, work: list[tuple[Seq, int]]) -> list[torch.Tensor]:
        """Run ``work`` = [(seq, num_new_tokens)]; returns each entry's logits [n, vocab]."""
        order = sorted(range(len(work)), key=lambda i: work[i][1] != 1)
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        decode_state_slots: list[int] = []
        prefills: list[PrefillSpan] = []
        rows: dict[int, slice] = {}
        for i in order:
            seq, n = work[i]
            start, end = seq.computed, seq.computed + n
            while len(seq.blocks) * BLOCK_SIZE < end:
                seq.blocks.append(self.next_block)
                self.next_block += 1
            rows[i] = slice(len(token_ids), len(token_ids) + n)
            token_ids.extend(seq.token_ids[start:end])
            for pos in range(start, end):
                positions.append(pos)
                slots.append(seq.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            if n == 1:
                decode_tables.append(seq.blocks[: -(-end // BLOCK_SIZE)])
                decode_lens.append(end)
                decode_state_slots.append(seq.slot)
            else:
                table = torch.tensor(seq.blocks[: -(-end // BLOCK_SIZE)], dtype=torch.long)
                prefills.append(PrefillSpan(rows[i].start, n, end, table, seq.slot))
            seq.computed = end

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decode_tokens=len(decode_tables),
            prefills=prefills,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables])
            lens = torch.tensor(decode_lens)
            meta.decode_mask = (torch.arange(width * BLOCK_SIZE)[None, :] < lens[:, None])[:, None, None, :]
            meta.decode_context_lens, meta.max_decode_context_len = lens, max(decode_lens)
            meta.decode_state_slots = torch.tensor(decode_state_slots, dtype=torch.long)
        with torch.inference_mode():
            hidden = model(torch.tensor(token_ids), torch.tensor(positions), caches, meta)
            logits = model.compute_logits(hidden)
        return [logits[rows[i]] for i in range(len(work))]


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, TOKENIZER_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_caches(model: Qwen3_5ForCausalLM) -> list:
    return model.make_caches(NUM_BLOCKS, BLOCK_SIZE, NUM_SLOTS, torch.float32, torch.device("cpu"))


def test_caches_layout(model: Qwen3_5ForCausalLM) -> None:
    caches = new_caches(model)
    assert [type(c) for c in caches] == [tuple, tuple, tuple, torch.Tensor]
    conv, recurrent = caches[0]
    assert conv.shape == (NUM_SLOTS, 2 * 2 * 32 + 4 * 32, 3)
    assert recurrent.shape == (NUM_SLOTS, 4, 32, 32) and recurrent.dtype == torch.float32
    assert caches[3].shape == (2, NUM_BLOCKS, BLOCK_SIZE, 2, 32)
    # The sizes the memory budget is planned with are the tensors' own.
    config = model.config
    assert model.state_bytes_per_sequence(config, 4) == 3 * (conv[0].nbytes + recurrent[0].nbytes)
    assert model.kv_bytes_per_token(config, 4) == caches[3][:, 0, 0].nbytes


def test_prefill_then_batched_decode(model: Qwen3_5ForCausalLM, reference: Any) -> None:
    # 70 tokens cross a 64-token chunk boundary; 13 stay inside one chunk.
    a = Seq(random_tokens(70 + 4, seed=1), slot=3)
    b = Seq(random_tokens(13 + 4, seed=2), slot=1)
    caches = new_caches(model)
    step = Step()
    want_a, want_b = hf_logits(reference, a.token_ids), hf_logits(reference, b.token_ids)

    got_a, got_b = step.run(model, caches, [(a, 70), (b, 13)])  # both prompts in one batch
    torch.testing.assert_close(got_a, want_a[:70], atol=ATOL, rtol=0)
    torch.testing.assert_close(got_b, want_b[:13], atol=ATOL, rtol=0)

    for i in range(4):
        got_b, got_a = step.run(model, caches, [(b, 1), (a, 1)])
        torch.testing.assert_close(got_a[0], want_a[70 + i], atol=ATOL, rtol=0)
        torch.testing.assert_close(got_b[0], want_b[13 + i], atol=ATOL, rtol=0)
    # Untouched slots stay untouched: the step gathers and scatters only its own sequences' states.
    for cache in caches[:3]:
        assert not cache[0][[0, 2, 4, 5]].any() and not cache[1][[0, 2, 4, 5]].any()


def test_chunked_prefill_carries_state(model: Qwen3_5ForCausalLM, reference: Any) -> None:
    # A prompt run in 3 chunks (the middle one longer than a delta-rule chunk), next to a decoding
    # sequence so that decode and continued-prefill rows share each step.
    c = Seq(random_tokens(150 + 2, seed=3), slot=5)
    d = Seq(random_tokens(9 + 3, seed=4), slot=0)
    caches = new_caches(model)
    step = Step()
    want_c, want_d = hf_logits(reference, c.token_ids), hf_logits(reference, d.token_ids)

    (got_d,) = step.run(model, caches, [(d, 9)])
    torch.testing.assert_close(got_d, want_d[:9], atol=ATOL, rtol=0)
    done = 0
    for i, n in enumerate((50, 67, 33)):
        got_c, got_d = step.run(model, caches, [(c, n), (d, 1)])
        torch.testing.assert_close(got_c, want_c[done : done + n], atol=ATOL, rtol=0)
        torch.testing.assert_close(got_d[0], want_d[9 + i], atol=ATOL, rtol=0)
        done += n
    for i in range(2):
        (got_c,) = step.run(model, caches, [(c, 1)])
        torch.testing.assert_close(got_c[0], want_c[150 + i], atol=ATOL, rtol=0)


def test_fresh_sequences_ignore_stale_slot_state(model: Qwen3_5ForCausalLM, reference: Any) -> None:
    # Slots reused from earlier requests hold garbage; a new sequence must start from zero state,
    # both as a one-token prompt (which takes the decode path) and as a prefill span.
    caches = new_caches(model)
    for cache in caches[:3]:
        cache[0].normal_()
        cache[1].normal_()
    e = Seq(random_tokens(1 + 2, seed=5), slot=2)
    f = Seq(random_tokens(6, seed=6), slot=4)
    step = Step()
    want_e, want_f = hf_logits(reference, e.token_ids), hf_logits(reference, f.token_ids)
    got_e, got_f = step.run(model, caches, [(e, 1), (f, 6)])
    torch.testing.assert_close(got_e[0], want_e[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got_f, want_f, atol=ATOL, rtol=0)
    for i in range(2):
        (got_e,) = step.run(model, caches, [(e, 1)])
        torch.testing.assert_close(got_e[0], want_e[1 + i], atol=ATOL, rtol=0)


def test_prefill_spans_batched_through_attention(
    model: Qwen3_5ForCausalLM, reference: Any, batched_prefill_calls: list[int]
) -> None:
    # The full-attention layer runs a step's spans as one padded call (forced here for any size):
    # fresh prompts side by side, then continued chunks after their cached prefixes beside a decode.
    seqs = [Seq(random_tokens(n, seed=20 + i), slot=i) for i, n in enumerate((16, 16, 16, 6))]
    caches = new_caches(model)
    step = Step()
    wants = [hf_logits(reference, s.token_ids) for s in seqs]
    for got, want, n in zip(step.run(model, caches, list(zip(seqs, (10, 7, 13, 5)))), wants, (10, 7, 13, 5)):
        torch.testing.assert_close(got, want[:n], atol=ATOL, rtol=0)
    work = [(seqs[0], 6), (seqs[1], 9), (seqs[2], 3), (seqs[3], 1)]
    for got, want, (seq, n) in zip(step.run(model, caches, work), wants, work):
        torch.testing.assert_close(got, want[seq.computed - n : seq.computed], atol=ATOL, rtol=0)
    assert batched_prefill_calls == [4, 3]  # one call per step (one attention layer), holding every span


def test_chunked_rule_matches_recurrent_steps() -> None:
    # The chunked form is an exact rewrite of the token-by-token rule, whatever the chunk size.
    gen = torch.Generator().manual_seed(7)
    n, hk, hv, dk, dv = 37, 2, 4, 16, 8
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen) * 3
    beta = torch.rand(n, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen)
    step_state, outs = state[None], []
    for t in range(n):
        out, step_state = gated_delta_rule_recurrent(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                                     beta[t : t + 1], step_state)
        outs.append(out[0])
    for chunk_size in (1, 8, 64):
        out, final = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
        torch.testing.assert_close(out, torch.stack(outs), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, step_state[0], atol=1e-5, rtol=1e-5)


def test_padding_ids_never_sampled(model: Qwen3_5ForCausalLM) -> None:
    assert model.config.vocab_size == QWEN3_5_VOCAB_SIZE
    logits = torch.randn(2, QWEN3_5_VOCAB_SIZE)
    logits[:, TOKENIZER_VOCAB:] = 1e6  # padding rows of the embedding that would win every draw
    rows = [SamplingRow(SamplingParams(temperature=t).with_defaults(), [], [], None) for t in (0.0, 1.0)]
    sampler = Sampler(vocab_size=TOKENIZER_VOCAB)
    for _ in range(20):
        out = sampler(logits, SamplingMetadata.build(rows, TOKENIZER_VOCAB, logits.device))
        assert (out.token_ids < TOKENIZER_VOCAB).all()
