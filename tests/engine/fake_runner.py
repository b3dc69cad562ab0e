"""A runner with no model, for testing the engine's bookkeeping on its own."""

from __future__ import annotations

from tokenline.model.batch import SampledToken, ScheduledBatch, ScheduledSeq


class FakeRunner:
    """Samples ``(last token + 1) % vocab`` (or a scripted token) and records every batch.

    A sequence with drafts gets the token it would sample at each of its 1 + k positions, as if the
    drafts before that position were its output.
    """

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
            drafts = list(seq.draft_token_ids)
            last_known = seq.token_ids[len(seq.token_ids) - len(drafts) - 1]
            targets = [self._next(seq, len(seq.output_token_ids) + i, ([last_known] + drafts)[i])
                       for i in range(len(drafts) + 1)]
            out[seq.request_id] = SampledToken(targets[0], draft_targets=targets[1:])
        return out

    def _next(self, seq: ScheduledSeq, num_output: int, last_token: int) -> int:
        scripted = self.script.get(seq.request_id)
        if scripted and num_output < len(scripted):
            token = scripted[num_output]
        else:
            token = (last_token + 1) % self.vocab
        if token in seq.banned_token_ids:
            token = (token + 1) % self.vocab
        return token
