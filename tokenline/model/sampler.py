"""The sampler: turns one step's logits into token ids (and logprobs), vectorized over the batch.

The runner describes each row with a :class:`SamplingRow`, packs them once per step into a
:class:`SamplingMetadata` (tensors on the model's device, ``None`` for every stage no row needs)
and calls :class:`Sampler`. Stage order, as vLLM/OpenAI users expect:

1. drop the padding columns (ids >= the tokenizer's vocab size) so they can never be chosen;
   structured output: set every token the row's grammar bitmask forbids to -inf (so logprobs are
   those of the masked distribution, as in vLLM);
2. raw logprobs (log_softmax of the model's distribution), when any row asked for logprobs;
3. logit_bias, banned ids, repetition penalty (HF), frequency/presence penalties (OpenAI);
4. greedy rows: argmax;
5. random rows: temperature, top-k, top-p, min-p, then the exponential race
   ``argmax(probs / Exp(1))``, whose noise comes from the row's own generator when it is seeded.

At a 262,144-entry vocabulary (Gemma 3) a pass over the whole row is the cost, so nothing sorts or
softmaxes it where a partial pass suffices: a random row with top-k samples among its k largest
logits (torch.topk); one with top-p or min-p but no top-k among its CANDIDATES largest when they
hold everything its filters keep (most rows of a real model), else over the full row. (Logprobs
need the whole row's normaliser: one fused log_softmax, then a topk.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenline.model import cpu_kernels
from tokenline.sampling_params import SamplingParams



@dataclass
class SamplingRow:
    """What the runner knows about one row of the step's logits."""

    params: SamplingParams  # resolved with .with_defaults(): no None in temperature/top_*/min_p/repetition_penalty
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far for this sequence
    generator: torch.Generator | None  # set for seeded requests; persists across steps (owned by the request)
    banned_token_ids: Sequence[int] = ()  # e.g. EOS and stop ids while fewer than min_tokens were generated


@dataclass
class SamplingMetadata:
    """One step's sampling tensors. A field is ``None`` when no row needs that stage."""

    num_rows: int
    vocab_size: int  # the tokenizer's; id vocab_size is the padding value of the id tensors below
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None  # [B] bool, only for mixed batches
    temperature: torch.Tensor | None  # [B] float32, 1.0 on greedy rows; None when no random row scales
    top_k: torch.Tensor | None  # [B] int64 in [1, vocab_size]; vocab_size means off
    top_p: torch.Tensor | None  # [B] float32; 1.0 means off
    min_p: torch.Tensor | None  # [B] float32; 0.0 means off
    logit_bias_index: torch.Tensor | None  # [2, N] int64: (row, token id)
    logit_bias_values: torch.Tensor | None  # [N] float32
    banned_index: torch.Tensor | None  # [2, M] int64: (row, token id)
    repetition_penalty: torch.Tensor | None  # [B] float32; 1.0 means off
    frequency_penalty: torch.Tensor | None  # [B] float32
    presence_penalty: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64 padded with vocab_size; only with repetition_penalty
    output_token_ids: torch.Tensor | None  # [B, Lo] int64 padded with vocab_size; with any penalty
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row index -> seeded random row's RNG
    max_num_logprobs: int | None = None  # None: no row asked; else the largest top-k asked (may be 0)
    # Structured output: the constrained rows [G] int64 and their bitmasks [G, ceil(vocab / 32)] int32
    # (bit i of a row set = token i allowed); None when no row is constrained.
    grammar_rows: torch.Tensor | None = None
    grammar_bitmask: torch.Tensor | None = None

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty is not None
            or self.frequency_penalty is not None
            or self.presence_penalty is not None
        )

    @property
    def needs_logits_processing(self) -> bool:
        return (
            self.logit_bias_index is not None
            or self.banned_index is not None
            or self.needs_penalties
            or self.grammar_bitmask is not None
        )

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingMetadata:
        """Pack the rows' parameters into tensors on ``device``. One host-to-device copy per used stage."""
        num_rows = len(rows)
        greedy = [row.params.greedy for row in rows]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        # Random-only stages: greedy rows get neutral values so they do not switch a stage on.
        temperatures = [1.0 if g else float(row.params.temperature) for row, g in zip(rows, greedy)]
        top_ks = []
        for row, g in zip(rows, greedy):
            k = int(row.params.top_k)
            top_ks.append(vocab_size if g or k <= 0 or k >= vocab_size else k)
        top_ps = [1.0 if g else float(row.params.top_p) for row, g in zip(rows, greedy)]
        min_ps = [0.0 if g else float(row.params.min_p) for row, g in zip(rows, greedy)]
        used_top_ks = [k for k in top_ks if k < vocab_size]

        rep = [float(row.params.repetition_penalty) for row in rows]
        freq = [float(row.params.frequency_penalty) for row in rows]
        pres = [float(row.params.presence_penalty) for row in rows]
        use_rep = any(p != 1.0 for p in rep)
        use_freq = any(f != 0.0 for f in freq)
        use_pres = any(p != 0.0 for p in pres)

        # Only rows whose penalty is active contribute ids, so the padded width stays small.
        prompt_ids = None
        if use_rep:
            prompt_ids = _pad_ids(
                [row.prompt_token_ids if r != 1.0 else () for row, r in zip(rows, rep)], vocab_size, device
            )
        output_ids = None
        if use_rep or use_freq or use_pres:
            output_ids = _pad_ids(
                [
                    row.output_token_ids if (r != 1.0 or f != 0.0 or p != 0.0) else ()
                    for row, r, f, p in zip(rows, rep, freq, pres)
                ],
                vocab_size,
                device,
            )

        # Ids outside the tokenizer's vocabulary are dropped: they are padding, never sampled anyway.
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i, row in enumerate(rows):
            for token_id, bias in (row.params.logit_bias or {}).items():
                if 0 <= int(token_id) < vocab_size:
                    bias_rows.append(i)
                    bias_ids.append(int(token_id))
                    bias_values.append(float(bias))
            for token_id in row.banned_token_ids:
                if 0 <= int(token_id) < vocab_size:
                    banned_rows.append(i)
                    banned_ids.append(int(token_id))

        asked = [row.params.logprobs for row in rows if row.params.logprobs is not None]
        generators = {
            i: row.generator for i, (row, g) in enumerate(zip(rows, greedy)) if row.generator is not None and not g
        }
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if all_greedy or all_random else torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=floats(temperatures) if any(t != 1.0 for t in temperatures) else None,
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device) if used_top_ks else None,
            top_p=floats(top_ps) if any(p < 1.0 for p in top_ps) else None,
            min_p=floats(min_ps) if any(p > 0.0 for p in min_ps) else None,
            logit_bias_index=(
                torch.tensor([bias_rows, bias_ids], dtype=torch.int64, device=device) if bias_rows else None
            ),
            logit_bias_values=floats(bias_values) if bias_rows else None,
            banned_index=(
                torch.tensor([banned_rows, banned_ids], dtype=torch.int64, device=device) if banned_rows else None
            ),
            repetition_penalty=floats(rep) if use_rep else None,
            frequency_penalty=floats(freq) if use_freq else None,
            presence_penalty=floats(pres) if use_pres else None,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            generators=generators,
            max_num_logprobs=max(asked) if asked else None,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: raw log-prob of the sampled token; None when no row asked
    top_logprob_ids: torch.Tensor | None  # [B, k] int64, k = max logprobs asked, sorted by value desc
    top_logprobs: torch.Tensor | None  # [B, k] float32


class Sampler:
    """Samples one token per row. Stateless apart from the vocabulary size; call once per step."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size  # the tokenizer's; logits may carry padding columns beyond it

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        vocab = self.vocab_size
        if logits.shape[-1] < vocab:
            raise ValueError(f"logits have {logits.shape[-1]} columns, fewer than the vocabulary ({vocab})")
        if metadata.vocab_size != vocab:
            raise ValueError(f"metadata built for vocab {metadata.vocab_size}, sampler has {vocab}")
        # Slicing the padding columns away is the same as setting them to -inf, and cheaper:
        # nothing downstream can pick them, and seeded noise stays independent of the padding.
        logits = logits[:, :vocab]

        # Fast path: one argmax, no float32 copy.
        if metadata.all_greedy and not metadata.needs_logits_processing and metadata.max_num_logprobs is None:
            return SamplerOutput(_argmax(logits), None, None, None)

        # A private float32 copy where a stage below writes (masks, processors) or sums (logprobs);
        # sampling itself only reads the logits, so a plain step samples the runner's as they are.
        if metadata.needs_logits_processing or metadata.max_num_logprobs is not None:
            x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        else:
            x = logits
        if metadata.grammar_bitmask is not None:
            apply_grammar_bitmask(x, metadata.grammar_rows, metadata.grammar_bitmask)
        raw_logprobs = x.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None

        apply_logits_processors(x, metadata)

        if metadata.all_greedy:
            token_ids = _argmax(x)
        else:
            greedy_ids = _argmax(x) if metadata.greedy_mask is not None else None
            token_ids = self._sample_random(x, metadata)
            if greedy_ids is not None:
                token_ids = torch.where(metadata.greedy_mask, greedy_ids, token_ids)

        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_values, top_ids = raw_logprobs.topk(metadata.max_num_logprobs, dim=-1)  # sorted desc
        return SamplerOutput(token_ids, sampled, top_ids, top_values)

    def _sample_random(self, x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and the exponential race, reading ``x`` (never written).
        Each row samples among its candidates (filter_candidates) where they hold all its filters keep,
        the others over a float32 copy of their full row (_sample_full_rows)."""
        filtered = _filtered_rows(metadata, x.device)
        if filtered is None:  # no filter on any row: every row samples from its whole distribution
            token_ids = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
            rest = torch.arange(x.shape[0], device=x.device)
        else:
            candidates = filter_candidates(x, metadata, filtered)
            token_ids = _sample_among_candidates(candidates, metadata.generators)
            rest = (~candidates.fits).nonzero().flatten()
        if metadata.greedy_mask is not None:  # greedy rows' samples are replaced by their argmax anyway
            rest = rest[~metadata.greedy_mask[rest]]
        if rest.numel():
            # A float32 copy, written below.
            rows = (x.to(torch.float32, copy=True) if rest.numel() == x.shape[0]
                    else x[rest].to(torch.float32))
            if metadata.temperature is not None:
                rows.div_(metadata.temperature[rest].unsqueeze(1))
            generators = {i: metadata.generators[row] for i, row in enumerate(rest.tolist())
                          if row in metadata.generators}
            top_p = metadata.top_p[rest] if metadata.top_p is not None else None
            min_p = metadata.min_p[rest] if metadata.min_p is not None else None
            token_ids[rest] = _sample_full_rows(rows, top_p, min_p, generators, all_random=True)
        return token_ids


def _filtered_rows(metadata: SamplingMetadata, device: torch.device) -> torch.Tensor | None:
    """[B] bool: the rows with a filter on (top-k, top-p or min-p), which may sample among candidates;
    None when no row has one (build() leaves a stage None when no row uses it)."""
    if metadata.top_k is None and metadata.top_p is None and metadata.min_p is None:
        return None
    filtered = torch.zeros(metadata.num_rows, dtype=torch.bool, device=device)
    if metadata.top_k is not None:
        filtered |= metadata.top_k < metadata.vocab_size
    if metadata.top_p is not None:
        filtered |= metadata.top_p < 1.0
    if metadata.min_p is not None:
        filtered |= metadata.min_p > 0.0
    return filtered


# A row with top-p or min-p but no top-k first looks among its this many largest logits: where they hold
# all its filters keep (the nucleus of a real model's row), it samples there, and the full row is never
# sorted nor softmaxed (262,144 columns, 8 rows: a sort 571 ms, this topk 22; docs/benchmarks/2026-12-07-gemma3.md).
CANDIDATES = 1024


@dataclass
class Candidates:
    """Each row's largest logits (temperature applied) and what its filters keep among them."""

    ids: torch.Tensor  # [B, W] int64 token ids, by logit, largest first
    logits: torch.Tensor  # [B, W] float32; -inf past the row's own candidates
    keep: torch.Tensor  # [B, W] bool: kept by the row's top-k, top-p and min-p
    fits: torch.Tensor  # [B] bool: the candidates hold every token the row's filters keep
    count: torch.Tensor  # [B] int64: the row's own number of candidates (<= W)


def filter_candidates(x: torch.Tensor, metadata: SamplingMetadata, filtered: torch.Tensor) -> Candidates:
    """Temperature, top-k, top-p and min-p of the filtered rows of ``x`` [B, V] (logits, read only) among
    their largest logits: a row's top k, else its top CANDIDATES (unfiltered and greedy rows get one,
    and never fit). The temperature scales the candidates only: it does not change their order.

    Top-p over a top-k row's candidates is top-p of the distribution renormalised over its top k, as in
    the full sort; a row without top-k normalises its candidates by its whole row's logsumexp, so where
    they hold top_p of the mass they keep exactly what the full sort keeps. min-p compares with the most
    likely token, a ratio that normalising does not change. A top-k row keeps exactly k candidates: of
    tokens tied at the k-th logit, topk's order decides."""
    num_rows, vocab = x.shape
    has_top_k = (metadata.top_k < vocab) if metadata.top_k is not None else torch.zeros_like(filtered)
    # Each row's count is its own, whatever the batch: a seeded row draws the same noise in any batch.
    count = torch.where(filtered, min(CANDIDATES, vocab), 1)
    if metadata.top_k is not None:
        count = torch.where(has_top_k, metadata.top_k, count)
    width = int(count.max())
    values, ids = x.topk(width, dim=-1)  # [B, W], sorted desc
    values = values.to(torch.float32)
    temperature = metadata.temperature.unsqueeze(1) if metadata.temperature is not None else None
    if temperature is not None:
        values = values / temperature
    candidate = torch.arange(width, device=x.device) < count.unsqueeze(1)
    values.masked_fill_(~candidate, float("-inf"))
    keep = candidate.clone()
    fits = has_top_k.clone()
    if metadata.top_p is not None:
        on = metadata.top_p < 1.0
        normaliser = _logsumexp(values)
        whole = (on & ~has_top_k).nonzero().flatten()
        if whole.numel():  # only those rows pay for a pass over the whole row
            rows = x[whole].to(torch.float32)
            normaliser[whole] = _logsumexp(rows if temperature is None else rows.div_(temperature[whole]))
        probs = (values - normaliser).exp()
        above = probs.cumsum(dim=-1) - probs
        # Keep a token while the mass strictly above it is short of top_p.
        keep &= (above < metadata.top_p.unsqueeze(1)) | ~on.unsqueeze(1)
        fits |= on & (probs.sum(dim=-1) >= metadata.top_p)
    if metadata.min_p is not None:
        on = metadata.min_p > 0.0
        # p >= min_p * p_max, i.e. logit >= the top logit + log(min_p).
        threshold = values[:, :1] + metadata.min_p.clamp(min=1e-30).log().unsqueeze(1)
        keep &= (values >= threshold) | ~on.unsqueeze(1)
        # Sorted: every token past the last candidate is below the threshold when that one is.
        last = values.gather(1, (count - 1).unsqueeze(1))
        fits |= on & (last < threshold).squeeze(1)
    keep[:, 0] = True  # the most likely token always survives
    return Candidates(ids, values, keep, fits & filtered, count)


def _sample_among_candidates(candidates: Candidates, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """The exponential race among each row's kept candidates: token ids [B] (meaningless for rows that
    do not fit, whose generators are not drawn from)."""
    c = candidates
    probs = (c.logits - c.logits[:, :1]).exp_().masked_fill_(~c.keep, 0.0)
    fitting = {row: g for row, g in generators.items() if bool(c.fits[row])}
    chosen = _exponential_race(probs, fitting, all_random=False, widths=c.count)
    return c.ids.gather(1, chosen.unsqueeze(1)).squeeze(1)


def _sample_full_rows(x: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                      generators: dict[int, torch.Generator], all_random: bool) -> torch.Tensor:
    """Top-p (one sort), min-p and the race over every column of ``x`` [B, V]: rows whose filters keep
    more than candidates can show, or that have none."""
    if top_p is not None and bool((top_p < 1.0).any()):
        _apply_top_k_top_p_sorted(x, None, top_p)
    probs = x.softmax(dim=-1)
    if min_p is not None:
        max_probs = probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < min_p.unsqueeze(1) * max_probs, 0.0)
    return _exponential_race(probs, generators, all_random)


def apply_grammar_bitmask(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of ``rows`` of ``x`` [B, vocab] to -inf wherever their bitmask bit is clear
    (bit i % 32 of int32 word i // 32 stands for token i; tokens beyond the bitmask are forbidden)."""
    vocab = x.shape[-1]
    # numpy's unpackbits is about 20x faster on CPU than shifting every bit out with torch.
    forbidden = (_forbidden_numpy if bitmask.device.type == "cpu" else _forbidden_torch)(bitmask, vocab)
    if forbidden.shape[1] < vocab:
        forbidden = torch.nn.functional.pad(forbidden, (0, vocab - forbidden.shape[1]), value=True)
    if rows.numel() == x.shape[0]:  # every row constrained (rows are in order): no gather/scatter
        x.masked_fill_(forbidden, float("-inf"))
    else:
        x[rows] = x[rows].masked_fill_(forbidden, float("-inf"))


def _forbidden_numpy(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab] == 0)


def _forbidden_torch(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return (((bitmask.unsqueeze(-1) >> shifts) & 1) == 0).flatten(1)[:, :vocab]


def apply_logits_processors(x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """logit_bias, banned ids, repetition penalty, frequency/presence penalties on ``x`` [B, vocab], in place."""
    if metadata.logit_bias_index is not None:
        x.index_put_(tuple(metadata.logit_bias_index), metadata.logit_bias_values, accumulate=True)
    if metadata.banned_index is not None:
        x.index_put_(tuple(metadata.banned_index), torch.tensor(float("-inf"), device=x.device))
    if not metadata.needs_penalties:
        return x

    num_rows, vocab = x.shape
    output_counts = None
    if metadata.frequency_penalty is not None or metadata.presence_penalty is not None:
        output_counts = _token_counts(metadata.output_token_ids, num_rows, vocab)

    if metadata.repetition_penalty is not None:
        seen = _token_mask(metadata.prompt_token_ids, num_rows, vocab)
        if output_counts is not None:
            seen |= output_counts > 0
        else:
            seen |= _token_mask(metadata.output_token_ids, num_rows, vocab)
        penalty = metadata.repetition_penalty.unsqueeze(1)
        # HF semantics: push a seen token's logit towards "less likely" whatever its sign.
        penalized = torch.where(x > 0, x / penalty, x * penalty)
        x.copy_(torch.where(seen, penalized, x))

    if metadata.frequency_penalty is not None:
        x.sub_(metadata.frequency_penalty.unsqueeze(1) * output_counts)
    if metadata.presence_penalty is not None:
        x.sub_(metadata.presence_penalty.unsqueeze(1) * (output_counts > 0).to(x.dtype))
    return x


def _pad_ids(id_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, max_len] int64 ids padded with ``vocab_size``, a column that the scatters below then drop."""
    width = max((len(ids) for ids in id_lists), default=0)
    padded = torch.full((len(id_lists), max(width, 1)), vocab_size, dtype=torch.int64)
    for i, ids in enumerate(id_lists):
        if len(ids):
            padded[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    # An id outside the vocabulary would index past the scatter buffer; treat it as padding.
    padded.masked_fill_((padded < 0) | (padded > vocab_size), vocab_size)
    return padded.to(device)


def _token_counts(ids: torch.Tensor, num_rows: int, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 occurrence counts of the (padded) ids in each row."""
    counts = torch.zeros((num_rows, vocab + 1), dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _token_mask(ids: torch.Tensor, num_rows: int, vocab: int) -> torch.Tensor:
    """[B, vocab] bool: which ids occur in each row."""
    mask = torch.zeros((num_rows, vocab + 1), dtype=torch.bool, device=ids.device)
    mask.scatter_(1, ids, True)
    return mask[:, :vocab]


def _apply_top_k_top_p_sorted(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> None:
    """Top-k then top-p with one ascending sort (needed anyway for the cumulative probabilities)."""
    sorted_x, order = x.sort(dim=-1, descending=False)
    vocab = x.shape[-1]
    if top_k is not None:
        # In ascending order the k-th largest sits at column vocab - k.
        kth = sorted_x.gather(1, (vocab - top_k).unsqueeze(1))
        sorted_x.masked_fill_(sorted_x < kth, float("-inf"))
    cumulative = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    # Drop the low tail while what remains still holds at least top_p of the mass.
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives, even when rounding says otherwise
    sorted_x.masked_fill_(drop, float("-inf"))
    x.scatter_(1, order, sorted_x)


def _exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator], all_random: bool,
                      widths: torch.Tensor | None = None) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1): a sample from ``probs`` (any positive scale per row) without a
    CDF search; the column chosen.

    Each seeded row draws its own noise from its generator, as many values each step as its row has
    columns (``widths[row]`` leading ones where given: its candidates), so its tokens depend on nothing
    but its own logits and generator: not on the batch or its place in it.
    q is made as -log(U), U ~ Uniform[0, 1): the same distribution as ``exponential_``, about four
    times cheaper on CPU. U < 1 keeps q > 0; U == 0 gives q = inf, i.e. that token cannot win.
    """
    noise = torch.empty_like(probs)
    if not (all_random and len(generators) == probs.shape[0]):
        noise.uniform_()  # one draw from the default RNG for every unseeded row
    for row, generator in generators.items():
        if widths is None:
            noise[row].uniform_(generator=generator)
        else:
            width = int(widths[row])
            noise[row, :width].uniform_(generator=generator)
            noise[row, width:] = 0.5  # past the row's candidates: zero probability, any noise
    noise.log_().neg_()
    # torch's max, not _argmax: a zero probability over a zero draw is NaN, and torch's handling of it
    # is the one the seeded streams were written against.
    return probs.div_(noise).max(dim=-1).indices


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[B, 1] log(sum(exp(x))) of each row of ``x`` [B, V]: max + log(sum(exp(x - max))), which on CPU
    is tens of times faster than torch.logsumexp over a 262,144-column row."""
    top = x.amax(dim=-1, keepdim=True)
    return (x - top).exp_().sum(dim=-1, keepdim=True).log_().add_(top)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum (the first one on ties, like argmax) of logits: our kernel on CPU
    (0.1 against torch's 1.4 ms at 32 x 49152 bfloat16), else ``max``, which has a vectorized kernel
    and is several times faster than ``argmax`` over a vocabulary-wide row."""
    kernels = cpu_kernels.load() if x.device.type == "cpu" else None
    indices = kernels.argmax_rows(x) if kernels is not None else None
    return indices if indices is not None else x.max(dim=-1).indices
