"""A runner with no model, for testing the engine's bookkeeping on its own."""

from __future__ import annotations

from tokenline.engine.batch import SampledToken, ScheduledBatch


class FakeRunner:
    """Samples ``(last token + 1) % vocab`` (or a scripted token) and records every batch."""

    def __init__(self, vocab: int = 1000, script: dict[str, list[int]] | None = None) -> None:
        self.vocab = vocab
        self.script = script or {}
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> dict[str, SampledToken]:
        self.batches.append(batch)
        out = {}
        for seq in batch.seqs:
            if not seq.sample:
                continue
            scripted = self.script.get(seq.request_id)
            if scripted and len(seq.output_token_ids) < len(scripted):
                token = scripted[len(seq.output_token_ids)]
            else:
                token = (seq.token_ids[-1] + 1) % self.vocab
            if token in seq.banned_token_ids:
                token = (token + 1) % self.vocab
            out[seq.request_id] = SampledToken(token)
        return out
