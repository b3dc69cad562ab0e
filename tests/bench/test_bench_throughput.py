"""`tokenline bench throughput`'s workloads and table (no model run here)."""

from __future__ import annotations

from pathlib import Path

from tokenline.bench.throughput import PASSAGE_SENTENCES, ThroughputResult, format_table, repeat_prompts
from tokenline.frontend.tokenizer import Tokenizer


def test_repeat_prompts_are_seeded_chats_around_a_passage(default_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(default_model_dir)
    prompts = repeat_prompts(3, 200, tokenizer, seed=0)
    assert prompts == repeat_prompts(3, 200, tokenizer, seed=0)
    assert len({tuple(p) for p in prompts}) == 3  # each prompt its own order of sentences
    assert prompts != repeat_prompts(3, 200, tokenizer, seed=1)
    for ids in prompts:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        assert "Repeat the following text" in text and "<|im_start|>assistant" in text
        assert sum(sentence in text for sentence in PASSAGE_SENTENCES) >= 5
        assert 200 <= len(ids) <= 200 + 80  # the passage, plus one sentence and the chat frame at most


def test_table_shows_acceptance_and_speedup_over_no_speculation() -> None:
    off = ThroughputResult("tokenline", "bfloat16", 4, 1000, 512, 10.0)
    on = ThroughputResult("tokenline", "bfloat16", 4, 1000, 512, 5.0, "ngram", draft_tokens=400, accepted_tokens=300)
    table = format_table([off, on]).splitlines()
    assert "accept" in table[0] and "vs off" in table[0]
    assert "75%" in table[2] and "2.00x" in table[2]
    assert "ngram" in table[2] and "off" in table[1] and "x" not in table[1]
