"""Sampler tests: pure CPU, random logits, no model."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from tokenline.model.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    _apply_top_k_top_p_sorted,
    _apply_top_p_among_candidates,
    _apply_top_k_top_p_truncated,
    apply_logits_processors,
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


def test_top_p_within_top_k_matches_the_sorted_path() -> None:
    logits = random_logits(6, 14, scale=2.0, width=VOCAB)
    top_k = torch.tensor([3, 10, 1, VOCAB, 25, 7])
    top_p = torch.tensor([0.5, 0.9, 0.3, 1.0, 0.99, 1.0])
    rows = [make_row(temperature=1.0, top_k=int(k) % VOCAB, top_p=float(p)) for k, p in zip(top_k, top_p)]
    metadata = SamplingMetadata.build(rows, VOCAB, torch.device("cpu"))
    assert metadata.top_p_within_top_k and metadata.max_top_k == 25
    truncated, full = logits.clone(), logits.clone()
    _apply_top_k_top_p_truncated(truncated, metadata.top_k, metadata.max_top_k, metadata.top_p)
    _apply_top_k_top_p_sorted(full, metadata.top_k, metadata.top_p)
    assert torch.equal(truncated.isinf(), full.isinf())
    assert torch.equal(truncated[~truncated.isinf()], logits[~truncated.isinf()])
    assert (~truncated[3].isinf()).all()  # the row with both filters off keeps everything
    assert (~truncated.isinf()).sum(-1)[2] == 1


def test_temperature_frequencies_match_softmax() -> None:
    torch.manual_seed(1234)
    vocab, draws, temperature = 6, 40000, 0.7
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.2, 50.0, 50.0])  # last two are padding
    logits = logits_row.expand(draws, 8).contiguous()
    rows = [make_row(temperature=temperature)] * draws
    out = sample(logits, rows, vocab=vocab)
    counts = torch.bincount(out.token_ids, minlength=8).double()
    assert counts[vocab:].sum() == 0
    expected = (logits_row[:vocab].double() / temperature).softmax(-1)
    frequencies = counts[:vocab] / draws
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert ((frequencies - expected).abs() <= 5 * sigma + 1e-4).all(), (frequencies, expected)


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


def test_top_p_alone_among_candidates_matches_the_sorted_path() -> None:
    """A 262,144-column vocabulary (Gemma 3's): peaked rows find their nucleus among the top 1,024
    and keep exactly what the full sort keeps; a flat row whose nucleus is wider declines (False,
    untouched) and the sampler sorts it."""
    gen = torch.Generator().manual_seed(5)
    vocab = 262_144
    # A model's row: a few hundred plausible tokens well above a long tail.
    peaked = torch.randn(4, vocab, generator=gen) * 2.0
    peaked[:, torch.randperm(vocab, generator=gen)[:300]] += 14.0 + torch.randn(4, 300, generator=gen) * 2.0
    top_p = torch.tensor([0.5, 0.9, 0.95, 1.0])
    ours, full = peaked.clone(), peaked.clone()
    assert _apply_top_p_among_candidates(ours, top_p)
    _apply_top_k_top_p_sorted(full, None, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(full))
    assert not torch.isinf(ours[3]).any() and torch.isinf(ours[0]).sum() > vocab - 1024
    flat = torch.randn(2, vocab, generator=gen) * 0.1
    untouched = flat.clone()
    assert not _apply_top_p_among_candidates(flat, torch.tensor([0.9, 0.9]))
    assert torch.equal(flat, untouched)
