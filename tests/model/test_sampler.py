"""Sampler tests: pure CPU, random logits, no model."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from tokenline.model import sampler as sampler_module
from tokenline.model.sampler import (
    CANDIDATES,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    _apply_top_k_top_p_sorted,
    apply_logits_processors,
    filter_candidates,
)
from tokenline.sampling_params import SamplingParams

VOCAB = 50
PADDED = 64  # logits carry padding columns, as a model with a vocabulary padded for parallelism does


def make_row(
    *,
    seed: int | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    banned: Sequence[int] = (),
    **params: object,
) -> SamplingRow:
    sampling = SamplingParams(seed=seed, **params).with_defaults()
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(sampling, list(prompt), list(output), generator, tuple(banned))


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], vocab: int = VOCAB) -> SamplerOutput:
    metadata = SamplingMetadata.build(rows, vocab, logits.device)
    return Sampler(vocab)(logits, metadata)


def random_logits(num_rows: int, seed: int, scale: float = 3.0, width: int = PADDED) -> torch.Tensor:
    return torch.randn(num_rows, width, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_equals_argmax() -> None:
    logits = random_logits(8, 0)
    out = sample(logits, [make_row(temperature=0.0) for _ in range(8)])
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits[:, :VOCAB].argmax(-1))
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None


def test_greedy_bf16_logits_and_input_not_modified() -> None:
    logits = random_logits(6, 1)
    before = logits.clone()
    rows = [make_row(temperature=0.0, repetition_penalty=1.3, prompt=[1, 2, 3], logit_bias={4: 5.0})] * 6
    sample(logits, rows)
    assert torch.equal(logits, before)  # the sampler works on its own copy
    bf16 = logits.to(torch.bfloat16)
    out = sample(bf16, [make_row(temperature=0.0) for _ in range(6)])
    assert torch.equal(out.token_ids, bf16.float()[:, :VOCAB].argmax(-1))
    # random rows without processors sample the runner's logits in place of a copy: read, never written
    rows = [make_row(temperature=0.5, top_k=3), make_row(temperature=2.0, top_p=0.5),
            make_row(temperature=0.7, min_p=0.2), make_row(temperature=1.5), make_row(temperature=0.0),
            make_row(temperature=1.2, top_p=0.9, seed=1)]
    for tensor in (logits, bf16):
        kept = tensor.clone()
        sample(tensor, rows)
        assert torch.equal(tensor, kept)


def test_padding_ids_never_sampled_nor_in_top_logprobs() -> None:
    logits = random_logits(6, 2)
    logits[:, VOCAB:] = 1e4  # padding columns that would win everything if they were visible
    rows = [
        make_row(temperature=0.0, logprobs=20),
        make_row(temperature=1.0, logprobs=20),
        make_row(temperature=1.0, top_k=3, logprobs=5),
        make_row(temperature=1.0, top_p=0.5),
        make_row(temperature=2.0, min_p=0.1, seed=7),
        # ids beyond the vocabulary in the history or the bias must not crash nor leak
        make_row(temperature=1.0, repetition_penalty=1.5, prompt=[VOCAB + 3, 1], output=[PADDED + 10],
                 frequency_penalty=1.0, logit_bias={VOCAB + 1: 100.0}),
    ]
    for _ in range(50):
        out = sample(logits, rows)
        assert (out.token_ids < VOCAB).all()
        assert (out.top_logprob_ids < VOCAB).all()
        assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.top_logprobs).all()


def test_no_padding_columns() -> None:
    logits = random_logits(4, 3, width=VOCAB)
    out = sample(logits, [make_row(temperature=0.0), make_row(temperature=1.0, top_p=0.9, logprobs=3)] * 2)
    assert out.token_ids[0] == logits[0].argmax()
    assert (out.token_ids < VOCAB).all()


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = random_logits(16, 4)
    expected = logits[:, :VOCAB].argmax(-1)
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.3}):
        for temperature in (0.5, 1.0, 3.0):
            rows = [make_row(temperature=temperature, **params) for _ in range(16)]
            for _ in range(5):
                assert torch.equal(sample(logits, rows).token_ids, expected), (params, temperature)


def _probs(logits_row: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits_row[:VOCAB].double() / temperature).softmax(-1)


def _top_k_set(probs: torch.Tensor, k: int) -> set[int]:
    return set(probs.topk(k).indices.tolist())


def _top_p_set(probs: torch.Tensor, p: float) -> set[int]:
    values, ids = probs.sort(descending=True)
    kept, total = set(), 0.0
    for value, token in zip(values.tolist(), ids.tolist()):
        kept.add(token)
        total += value
        if total >= p:
            break
    return kept


def _min_p_set(probs: torch.Tensor, min_p: float) -> set[int]:
    return set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())


def test_filters_never_emit_outside_the_allowed_set() -> None:
    torch.manual_seed(0)
    draws = 3000
    logits_row = random_logits(1, 5, scale=1.5)[0]
    logits = logits_row.expand(draws, PADDED).contiguous()
    temperature = 1.3
    probs = _probs(logits_row, temperature)
    cases = {
        "top_k": ({"top_k": 5}, _top_k_set(probs, 5)),
        "top_p": ({"top_p": 0.6}, _top_p_set(probs, 0.6)),
        "min_p": ({"min_p": 0.3}, _min_p_set(probs, 0.3)),
    }
    # top-k then top-p: top-p works on the distribution renormalized over the top k.
    top10 = sorted(_top_k_set(probs, 10))
    renormalized = torch.zeros_like(probs)
    renormalized[top10] = probs[top10] / probs[top10].sum()
    cases["top_k+top_p"] = ({"top_k": 10, "top_p": 0.7}, _top_p_set(renormalized, 0.7))
    for name, (params, allowed) in cases.items():
        out = sample(logits, [make_row(temperature=temperature, **params) for _ in range(draws)])
        seen = set(out.token_ids.tolist())
        assert seen <= allowed, name
        assert len(seen) > 1, name  # the filter must not collapse to greedy


def test_per_row_filters_in_one_batch() -> None:
    torch.manual_seed(1)
    logits = random_logits(8, 6, scale=1.0)
    settings = [
        {"top_k": 1}, {"top_k": 3}, {"top_k": 7}, {"top_k": 0},
        {"top_p": 0.5}, {"top_k": 4, "top_p": 0.9}, {"min_p": 0.5}, {"top_k": -1, "top_p": 1.0},
    ]
    rows = [make_row(temperature=1.0, **s) for s in settings]
    allowed = []
    for i, s in enumerate(settings):
        probs = _probs(logits[i], 1.0)
        ids = set(range(VOCAB))
        if s.get("top_k", 0) > 0:
            ids = _top_k_set(probs, s["top_k"])
        if s.get("top_p", 1.0) < 1.0:
            kept = sorted(ids)
            renormalized = torch.zeros_like(probs)
            renormalized[kept] = probs[kept] / probs[kept].sum()
            ids = _top_p_set(renormalized, s["top_p"])
        if "min_p" in s:
            ids = _min_p_set(probs, s["min_p"])
        allowed.append(ids)
    seen: list[set[int]] = [set() for _ in settings]
    for _ in range(300):
        for i, token in enumerate(sample(logits, rows).token_ids.tolist()):
            assert token in allowed[i], (i, settings[i])
            seen[i].add(token)
    assert len(seen[3]) > 10 and len(seen[7]) > 10  # rows with every filter off do roam


def _kept_by_full_sort(logits: torch.Tensor, rows: Sequence[SamplingRow], vocab: int) -> list[set[int]]:
    """The reference: each row's tokens left by a full-vocabulary sort (top-k, then top-p on the
    renormalised rest) and min-p over the full softmax, at temperature 1."""
    metadata = SamplingMetadata.build(rows, vocab, logits.device)
    x = logits[:, :vocab].clone()
    top_p = metadata.top_p if metadata.top_p is not None else torch.ones(len(rows))
    _apply_top_k_top_p_sorted(x, metadata.top_k, top_p)
    probs = x.softmax(-1)
    if metadata.min_p is not None:
        probs.masked_fill_(probs < metadata.min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), 0.0)
    return [set(torch.nonzero(row > 0).flatten().tolist()) for row in probs]


def _kept_among_candidates(logits: torch.Tensor, rows: Sequence[SamplingRow], vocab: int):
    metadata = SamplingMetadata.build(rows, vocab, logits.device)
    filtered = sampler_module._filtered_rows(metadata, logits.device)
    c = filter_candidates(logits[:, :vocab].clone(), metadata, filtered)
    kept = [set(c.ids[i][c.keep[i]].tolist()) for i in range(len(rows))]
    return kept, c.fits.tolist(), c.count.tolist()


def test_top_k_and_top_p_among_candidates_match_the_full_sort() -> None:
    logits = random_logits(6, 14, scale=2.0, width=VOCAB)
    settings = [(3, 0.5), (10, 0.9), (1, 0.3), (0, 1.0), (25, 0.99), (7, 1.0)]
    rows = [make_row(temperature=1.0, top_k=k, top_p=p) for k, p in settings]
    kept, fits, count = _kept_among_candidates(logits, rows, VOCAB)
    assert kept[:3] + kept[4:] == [s for i, s in enumerate(_kept_by_full_sort(logits, rows, VOCAB)) if i != 3]
    assert fits == [True, True, True, False, True, True]  # the row without a filter samples the full row
    assert count == [3, 10, 1, 1, 25, 7] and len(kept[2]) == 1


def _model_like_rows(num_rows: int, vocab: int, gen: torch.Generator, spread: float = 2.0) -> torch.Tensor:
    """Rows like a real model's at Gemma 3's vocabulary: a few hundred plausible tokens well above a long tail."""
    peaked = torch.randn(num_rows, vocab, generator=gen) * 2.0
    peaked[:, torch.randperm(vocab, generator=gen)[:300]] += 14.0 + torch.randn(num_rows, 300, generator=gen) * spread
    return peaked


def test_top_p_and_min_p_alone_among_candidates_match_the_full_sort() -> None:
    """A 262,144-column vocabulary (Gemma 3's): peaked rows find what top-p and min-p keep among their
    CANDIDATES largest logits and keep exactly what the full sort keeps; flat rows, whose nucleus is
    wider, do not fit and are left to the full row."""
    gen = torch.Generator().manual_seed(5)
    vocab = 262_144
    peaked = _model_like_rows(4, vocab, gen)
    flat = torch.randn(3, vocab, generator=gen) * 0.1
    logits = torch.cat([peaked, flat])
    settings = [{"top_p": 0.5}, {"top_p": 0.95}, {"min_p": 0.05}, {"top_p": 0.9, "min_p": 0.1},
                {"top_p": 0.9}, {"min_p": 0.5}, {"top_p": 0.9, "min_p": 0.99}]
    rows = [make_row(temperature=1.0, **s) for s in settings]
    kept, fits, count = _kept_among_candidates(logits, rows, vocab)
    reference = _kept_by_full_sort(logits, rows, vocab)
    assert count == [CANDIDATES] * 7
    # flat rows: top-p 0.9 and min-p 0.5 keep far more than CANDIDATES tokens; min-p 0.99 of a flat
    # row keeps a handful, so with it the row fits whatever its top-p
    assert fits == [True, True, True, True, False, False, True]
    for i, fit in enumerate(fits):
        if fit:
            assert kept[i] == reference[i], settings[i]
    assert len(reference[4]) > CANDIDATES and len(reference[5]) > CANDIDATES


def test_gemma_defaults_sample_among_candidates_within_the_full_sort_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's generation config (top_k=64, top_p=0.95) at its 262,144-entry vocabulary: every row
    samples among its 64 candidates, never through the full-row path, and only tokens the full sort keeps."""
    gen = torch.Generator().manual_seed(9)
    vocab = 262_144
    logits = _model_like_rows(8, vocab, gen, spread=0.5).to(torch.bfloat16)
    rows = [make_row(temperature=1.0, top_k=64, top_p=0.95, seed=s if s % 2 else None) for s in range(8)]
    allowed = _kept_by_full_sort(logits.float(), rows, vocab)

    def full_row_path(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a Gemma-default row took the full-vocabulary path")

    monkeypatch.setattr(sampler_module, "_sample_full_rows", full_row_path)
    seen: list[set[int]] = [set() for _ in rows]
    for _ in range(20):
        for i, token in enumerate(sample(logits, rows, vocab=vocab).token_ids.tolist()):
            assert token in allowed[i]
            seen[i].add(token)
    assert all(len(s) > 1 for s in seen)  # sampling, not greedy


def test_rows_that_do_not_fit_sample_the_full_row_in_any_batch() -> None:
    """A flat top-p row (its nucleus wider than the candidates) samples among the full sort's set; a
    seeded one draws the same tokens alone and beside a top-k row, which samples among candidates."""
    gen = torch.Generator().manual_seed(11)
    vocab = 8 * CANDIDATES
    flat = torch.randn(1, vocab, generator=gen) * 0.1
    peaked = _model_like_rows(1, vocab, gen)
    target = {"temperature": 1.0, "top_p": 0.9, "seed": 3}
    allowed = _kept_by_full_sort(flat, [make_row(**target)], vocab)[0]
    alone_row, batch_row = make_row(**target), make_row(**target)
    other = make_row(temperature=0.8, top_k=5, seed=4)
    alone, in_batch = [], []
    for _ in range(6):
        alone.append(int(sample(flat, [alone_row], vocab=vocab).token_ids[0]))
        out = sample(torch.cat([peaked, flat]), [other, batch_row], vocab=vocab)
        in_batch.append(int(out.token_ids[1]))
        assert int(out.token_ids[0]) in set(peaked[0].topk(5).indices.tolist())
    assert alone == in_batch and set(alone) <= allowed and len(set(alone)) > 1


def test_temperature_frequencies_match_softmax() -> None:
    torch.manual_seed(1234)
    vocab, draws, temperature = 6, 40000, 0.7
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.2, 50.0, 50.0])  # last two are padding
    logits = logits_row.expand(draws, 8).contiguous()
    # the full row, then among the top 3 candidates (the distribution renormalised over them)
    for params in ({}, {"top_k": 3}):
        rows = [make_row(temperature=temperature, **params)] * draws
        out = sample(logits, rows, vocab=vocab)
        counts = torch.bincount(out.token_ids, minlength=8).double()
        assert counts[vocab:].sum() == 0
        scaled = logits_row[:vocab].double() / temperature
        if params:
            scaled[scaled < scaled.topk(3).values[-1]] = float("-inf")
        expected = scaled.softmax(-1)
        frequencies = counts[:vocab] / draws
        sigma = (expected * (1 - expected) / draws).sqrt()
        assert ((frequencies - expected).abs() <= 5 * sigma + 1e-4).all(), (params, frequencies, expected)


SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 30, "frequency_penalty": 0.5, "seed": 123}


def _run_seeded(position: int, batch_size: int, others_seed: int, steps: int = 8) -> list[int]:
    """Decode ``steps`` tokens for the SEEDED row placed at ``position`` among random other rows."""
    target = make_row(**SEEDED)
    noise = torch.Generator().manual_seed(others_seed)
    others = [
        make_row(temperature=0.0),
        make_row(temperature=1.0),
        make_row(temperature=1.5, seed=99, top_k=5),
        make_row(temperature=0.7, top_p=0.5, presence_penalty=1.0, logprobs=3),
        make_row(temperature=1.0, seed=7, min_p=0.1, banned=[1, 2]),
    ][: batch_size - 1]
    tokens: list[int] = []
    for step in range(steps):
        target_logits = random_logits(1, 1000 + step, scale=1.0)
        other_logits = torch.randn(len(others), PADDED, generator=noise) * 2.0
        parts = list(other_logits)
        parts.insert(position, target_logits[0])
        rows = list(others)
        rows.insert(position, target)
        out = sample(torch.stack(parts), rows)
        token = int(out.token_ids[position])
        tokens.append(token)
        target.output_token_ids.append(token)
        for row, other_token in zip(others, out.token_ids[[i for i in range(len(rows)) if i != position]].tolist()):
            row.output_token_ids.append(other_token)
    return tokens


def test_seeded_row_is_independent_of_the_batch() -> None:
    alone = _run_seeded(position=0, batch_size=1, others_seed=0)
    torch.manual_seed(5)
    in_batch = _run_seeded(position=0, batch_size=6, others_seed=1)
    torch.manual_seed(6)
    elsewhere = _run_seeded(position=4, batch_size=6, others_seed=2)
    middle = _run_seeded(position=2, batch_size=3, others_seed=3)
    assert alone == in_batch == elsewhere == middle
    assert len(set(alone)) > 1


def test_different_seeds_differ() -> None:
    logits = random_logits(1, 8, scale=0.1)
    sequences = []
    for seed in (1, 2):
        row = make_row(temperature=1.0, seed=seed)
        sequences.append([int(sample(logits, [row]).token_ids[0]) for _ in range(8)])
    assert sequences[0] != sequences[1]
    # and a seeded row advances its own generator: its tokens vary across steps
    assert len(set(sequences[0])) > 1


def test_penalties_match_hand_computed_reference() -> None:
    vocab = 10
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, -0.5, 4.0, 0.2, 9.0, 9.0],
            [1.0, 1.0, -1.0, -3.0, 2.0, 0.0, -1.0, 0.5, -2.0, 0.2, 9.0, 9.0],
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 9.0, 9.0],
        ]
    )
    specs = [
        {"repetition_penalty": 2.0, "prompt": [0, 1, 1], "output": [3, 4]},
        {"frequency_penalty": 0.5, "presence_penalty": 0.25, "repetition_penalty": 1.5,
         "prompt": [2], "output": [0, 0, 0, 4, 7, 0]},
        {"prompt": [1, 2], "output": [3, 3]},  # no penalties: unchanged even though others use them
    ]
    rows = []
    expected = logits[:, :vocab].clone()
    for i, spec in enumerate(specs):
        prompt, output = spec["prompt"], spec["output"]
        params = {k: v for k, v in spec.items() if k not in ("prompt", "output")}
        rows.append(make_row(temperature=1.0, prompt=prompt, output=output, **params))
        rep = params.get("repetition_penalty", 1.0)
        for token in set(prompt) | set(output):
            value = expected[i, token].item()
            expected[i, token] = value / rep if value > 0 else value * rep
        for token in set(output):
            count = output.count(token)
            expected[i, token] -= params.get("frequency_penalty", 0.0) * count
            expected[i, token] -= params.get("presence_penalty", 0.0)
    metadata = SamplingMetadata.build(rows, vocab, torch.device("cpu"))
    processed = apply_logits_processors(logits[:, :vocab].clone(), metadata)
    torch.testing.assert_close(processed, expected)


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0]])
    assert sample(logits, [make_row(temperature=0.0)], vocab=4).token_ids.tolist() == [1]
    row = make_row(temperature=0.0, presence_penalty=0.5, output=[1])
    assert sample(logits, [row], vocab=4).token_ids.tolist() == [2]
    row = make_row(temperature=0.0, repetition_penalty=1.2, prompt=[1])
    assert sample(logits, [row], vocab=4).token_ids.tolist() == [2]


def test_logit_bias_and_banned_ids() -> None:
    torch.manual_seed(2)
    logits = random_logits(4, 9)
    best = logits[:, :VOCAB].argmax(-1)
    second = logits[:, :VOCAB].topk(2).indices[:, 1]
    rows = [
        make_row(temperature=0.0, logit_bias={7: 100.0}),
        make_row(temperature=0.0, banned=[int(best[1])]),
        make_row(temperature=0.0, logit_bias={int(best[2]): -100.0}),
        make_row(temperature=1.0, logit_bias={11: 100.0}),
    ]
    out = sample(logits, rows)
    assert out.token_ids.tolist() == [7, int(second[1]), int(second[2]), 11]
    # banned ids never come out of random rows, whatever their logits
    hot = logits.clone()
    hot[:, :3] = 30.0
    rows = [make_row(temperature=1.0, banned=[0, 1, 2]) for _ in range(200)]
    out = sample(hot[:1].expand(200, PADDED), rows)
    assert not set(out.token_ids.tolist()) & {0, 1, 2}


def test_logprobs_are_raw_and_consistent() -> None:
    torch.manual_seed(3)
    logits = random_logits(5, 10)
    rows = [
        make_row(temperature=0.0, logprobs=0),
        make_row(temperature=0.5, logprobs=5, logit_bias={3: 20.0}, repetition_penalty=1.7, prompt=[1, 2]),
        make_row(temperature=1.0),  # asked nothing, still gets a row in the tensors
        make_row(temperature=1.2, top_k=3, logprobs=2, frequency_penalty=1.0, output=[4, 4]),
        make_row(temperature=0.0, logprobs=5, banned=[int(logits[4, :VOCAB].argmax())]),
    ]
    out = sample(logits, rows)
    raw = logits[:, :VOCAB].log_softmax(-1)  # before bias, penalties, temperature
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    assert out.top_logprob_ids.dtype == torch.int64
    assert out.top_logprob_ids.shape == (5, 5) and out.top_logprobs.shape == (5, 5)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    torch.testing.assert_close(out.top_logprobs, raw.gather(1, out.top_logprob_ids))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.equal(out.top_logprob_ids, raw.topk(5).indices)
    for i in range(5):
        ids = out.top_logprob_ids[i].tolist()
        token = int(out.token_ids[i])
        if token in ids:
            assert out.top_logprobs[i, ids.index(token)] == out.logprobs[i]
        else:
            assert out.logprobs[i] <= out.top_logprobs[i, -1]
    assert out.token_ids[0] == out.top_logprob_ids[0, 0]  # greedy with nothing else: the top token
    assert out.token_ids[1] == 3  # the bias steered the sample, not the reported logprobs
    assert out.token_ids[4] == out.top_logprob_ids[4, 1]  # banned top token: the second one


def test_logprobs_zero_gives_empty_top() -> None:
    logits = random_logits(2, 11)
    out = sample(logits, [make_row(temperature=0.0, logprobs=0), make_row(temperature=1.0)])
    assert out.logprobs.shape == (2,)
    assert out.top_logprob_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)


def test_mixed_greedy_and_random_batch() -> None:
    logits = random_logits(6, 12, scale=0.5)
    rows = [
        make_row(temperature=0.0),
        make_row(temperature=1.0, seed=1),
        make_row(temperature=0.0, top_k=5, top_p=0.2, min_p=0.3),  # filters do not apply to greedy rows
        make_row(temperature=2.0, seed=2, top_p=0.9),
        make_row(temperature=0.0),
        make_row(temperature=1.0, top_k=20),
    ]
    out = sample(logits, rows)
    expected = logits[:, :VOCAB].argmax(-1)
    for i in (0, 2, 4):
        assert out.token_ids[i] == expected[i]
    # seeded random rows sample exactly what they would alone
    for i, spec in ((1, {"temperature": 1.0, "seed": 1}), (3, {"temperature": 2.0, "seed": 2, "top_p": 0.9})):
        alone = sample(logits[i : i + 1], [make_row(**spec)])
        assert out.token_ids[i] == alone.token_ids[0]


def test_metadata_skips_unused_stages() -> None:
    rows = [make_row(temperature=0.0, top_k=5, top_p=0.5), make_row(temperature=0.0)]
    metadata = SamplingMetadata.build(rows, VOCAB, torch.device("cpu"))
    assert metadata.all_greedy and not metadata.needs_logits_processing
    for name in ("temperature", "top_k", "top_p", "min_p", "prompt_token_ids", "output_token_ids", "greedy_mask"):
        assert getattr(metadata, name) is None, name
    assert metadata.max_num_logprobs is None and metadata.generators == {}
    rows = [make_row(temperature=1.0, top_k=VOCAB + 5, seed=3), make_row(temperature=1.0, top_k=-1)]
    metadata = SamplingMetadata.build(rows, VOCAB, torch.device("cpu"))
    assert metadata.all_random and metadata.top_k is None and metadata.temperature is None
    assert list(metadata.generators) == [0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_contract() -> None:
    device = torch.device("cuda")
    logits = random_logits(4, 13).to(device)
    rows = [
        make_row(temperature=0.0, logprobs=3),
        make_row(temperature=1.0, top_p=0.8, repetition_penalty=1.2, prompt=[1, 2]),
        make_row(temperature=0.8, top_k=4, frequency_penalty=0.5, output=[3, 3], banned=[5]),
        make_row(temperature=1.0, min_p=0.2, logit_bias={6: 2.0}),
    ]
    for row, seed in zip(rows, (None, 1, 2, None)):
        if seed is not None:
            row.generator = torch.Generator(device=device).manual_seed(seed)
    metadata = SamplingMetadata.build(rows, VOCAB, device)
    out = Sampler(VOCAB)(logits, metadata)
    assert out.token_ids.device.type == "cuda"
    assert int(out.token_ids[0]) == int(logits[0, :VOCAB].argmax())
    assert (out.token_ids < VOCAB).all()
    assert math.isfinite(float(out.logprobs[0]))
