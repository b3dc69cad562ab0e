"""A runner without a model: placeholder tokens, and a clock advanced by the predicted step time."""

from __future__ import annotations

from tokenline.model.batch import SampledToken, ScheduledBatch
from tokenline.sim.roofline_scaling import StepTimeModel
from tokenline.sim.step_model import batch_features


class SimClock:
    """Simulated seconds; the engine reads it through ``__call__`` like ``time.monotonic``."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)


class PlaceholderRunner:
    """Samples ``(last token + 1) % vocab`` for each sampling sequence (accepting any drafts) and
    moves ``clock`` on by what ``step_model`` predicts for the batch.

    ``filler_token_id``, when set, is sampled instead: a token whose repeats a chat template renders
    back as the same ids, so a simulated multi-turn chat hits the prefix cache on its earlier answers
    as a real model's answers do (consecutive ids re-tokenize otherwise and miss from there)."""

    def __init__(self, clock: SimClock, step_model: StepTimeModel, vocab_size: int,
                 avoid_token_ids: frozenset[int] = frozenset(), step_overhead_s: float = 0.0,
                 filler_token_id: int | None = None, sliding_window: int | None = None) -> None:
        self.clock = clock
        self.step_model = step_model
        self.vocab_size = vocab_size
        # Never sampled (a served replica's special tokens and EOS): its text stays ordinary text.
        self.avoid_token_ids = avoid_token_ids
        self.step_overhead_s = step_overhead_s  # a server's host time per step (the profile's)
        self.filler_token_id = filler_token_id
        self.sliding_window = sliding_window  # the model's, for the step features (batch_features)

    def execute(self, batch: ScheduledBatch) -> dict[str, SampledToken]:
        self.clock.advance(self.step_model.predict(batch_features(batch, self.sliding_window)) + self.step_overhead_s)
        out = {}
        for seq in batch.seqs:
            if not seq.sample:
                continue
            drafts = list(seq.draft_token_ids)
            last = seq.token_ids[len(seq.token_ids) - len(drafts) - 1]
            targets = [self._next(t, seq.banned_token_ids) for t in [last, *drafts]]
            out[seq.request_id] = SampledToken(targets[0], draft_targets=targets[1:])
        return out

    def _next(self, token: int, banned: object) -> int:
        filler = self.filler_token_id
        if filler is not None and filler not in banned and filler not in self.avoid_token_ids:  # type: ignore[operator]
            return filler
        token = (token + 1) % self.vocab_size
        while token in banned or token in self.avoid_token_ids:  # type: ignore[operator]
            token = (token + 1) % self.vocab_size
        return token
