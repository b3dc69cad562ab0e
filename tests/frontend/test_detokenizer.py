"""Incremental detokenization: deltas add up to the full decode, and split characters come out whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tokenline.frontend.detokenizer import IncrementalDetokenizer
from tokenline.frontend.tokenizer import Tokenizer

FFFD = "\ufffd"
MULTIBYTE = "😀🎉 你好世界 日本語のテキスト 👨‍👩‍👧 🇫🇷 𝄞 한국어 ça"


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int] | None = None, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = []
    i = 0
    for n in chunks or [1] * len(ids):
        deltas.append(detok.push(ids[i : i + n]))
        i += n
    assert i == len(ids)
    deltas.append(detok.flush())
    return deltas


def test_vocabulary_splits_characters(tok: Tokenizer) -> None:
    # The premise of the next test: in this byte-level vocabulary, emoji and CJK take several
    # tokens that each decode to partial UTF-8.
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    partial = [i for i in ids if FFFD in tok.decode([i])]
    assert len(partial) >= 10


def test_split_characters_are_emitted_once_whole(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE
    assert not any(FFFD in d for d in deltas)
    for char in "😀🎉你好世界日本語テキ𝄞한국어ç":
        # Each character appears in exactly one delta, in one piece.
        assert sum(char in d for d in deltas) == MULTIBYTE.count(char), char
    # Tokens that complete nothing yield "" rather than a replacement character.
    assert "" in deltas[:-1]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_chunking_matches_full_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    text_ids = tok.encode(MULTIBYTE + " plain text\n" + MULTIBYTE[::-1], add_special_tokens=False)
    special = [tok.eos_token_id, tok.bos_token_id]
    for trial in range(50):
        if trial % 2:
            ids = list(text_ids)
            for _ in range(3):
                ids.insert(rng.randrange(len(ids)), rng.choice(special))
        else:
            # Arbitrary ids, as a badly sampled model might produce: invalid UTF-8 included.
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        chunks = []
        left = len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 4)))
            left -= chunks[-1]
        deltas = _stream(tok, ids, chunks, skip_special_tokens=skip_special_tokens)
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == full
        assert sum(d.count(FFFD) for d in deltas) == full.count(FFFD)


def test_truncated_character_is_released_on_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # generation stopped inside the emoji
    detok = IncrementalDetokenizer(tok)
    pushed = "".join(detok.push([i]) for i in cut)
    assert FFFD not in pushed
    assert pushed + detok.flush() == tok.decode(cut)
    assert tok.decode(cut).endswith(FFFD)
    assert detok.flush() == ""


def test_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    gen = tok.encode(" Hello 世界!", add_special_tokens=False) + [tok.eos_token_id]
    deltas = _stream(tok, gen, prompt_token_ids=prompt)
    assert "".join(deltas) == tok.decode(gen) == " Hello 世界!"


def test_fallback_path_is_consistent(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    out = [detok.push([i]) for i in ids[:7]]
    detok._stream = None  # what a DecodeStream error switches to
    out += [detok.push([i]) for i in ids[7:]]
    out.append(detok.flush())
    assert "".join(out) == MULTIBYTE
    assert not any(FFFD in d for d in out)


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    # A token-id prompt may end in a stray UTF-8 byte; the output's text must not take the prompt's
    # with it. Found on a random `bench serve` prompt: ... "epsilon" + a lone continuation byte,
    # then the model's two bytes of "ע".
    prompt = [34713, 2637, 35941, 120]
    assert tok.decode(prompt).endswith(FFFD)
    gen = [162, 112, 162, 117, 162]
    deltas = _stream(tok, gen, prompt_token_ids=prompt)
    assert deltas[0] == ""  # half a character
    assert "".join(deltas) == tok.decode(gen) == "עק" + FFFD


def test_random_prompt_tails_never_leak_into_the_output(tok: Tokenizer) -> None:
    rng = random.Random(1)
    gen = tok.encode(MULTIBYTE, add_special_tokens=False)  # starts with a whole character
    partial = [i for i in range(1000) if FFFD in tok.decode([i])]  # lone UTF-8 bytes
    broken = 0
    for _ in range(40):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        for _ in range(rng.randrange(1, 4)):
            prompt.insert(rng.randrange(len(prompt) + 1), rng.choice(partial))
        broken += FFFD in tok.decode(prompt[-4:])
        deltas = _stream(tok, gen, prompt_token_ids=prompt)
        assert "".join(deltas) == MULTIBYTE
        assert not any(FFFD in d for d in deltas)
    assert broken >= 5  # the premise: many of these tails hold broken characters


def test_prompt_tail_starting_inside_a_character(tok: Tokenizer) -> None:
    # The last four ids of this prompt begin with an emoji's last bytes: the context widens.
    prompt = tok.encode("say 😀😀", add_special_tokens=False)
    assert FFFD in tok.decode(prompt[-4:]) or len(prompt) < 8
    deltas = _stream(tok, tok.encode(" ok 你好", add_special_tokens=False), prompt_token_ids=prompt)
    assert "".join(deltas) == " ok 你好"
