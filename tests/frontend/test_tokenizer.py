"""Tokenizer: ids, special tokens and vocabulary size equal transformers' AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tokenline.frontend.tokenizer import Tokenizer

CORPUS = [
    "",
    "hello world",
    "Hello, World!  Two  spaces and a trailing space ",
    "   leading spaces",
    "\n\nnewlines\r\nand\ttabs\t\t",
    "def f(x):\n    return x ** 2  # squared\n",
    "Numbers: 1234567890 3.14159 -42 1e-9 0x1F",
    "😀🎉 emoji 👨‍👩‍👧 family 🇫🇷 flag",
    "中文文本：你好，世界！日本語のテキスト。한국어 텍스트",
    "Ünïcödé àccents — “quotes” ‘single’ … ß ø",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|>",
    "<|im_start|> spaces around <|im_end|> ",
    "partial <|im_start special <|im_end",
    "https://example.com/path?q=1&r=2#frag",
    "a" * 500,
    "The quick brown fox jumps over the lazy dog. " * 20,
    "\u200b zero width \ufeff bom \ufffd replacement",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝄞 music",
    "{\"json\": [1, 2, {\"k\": null}]}",
]


@pytest.fixture(scope="module")
def hf(default_model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


def test_encode_matches_transformers(tok: Tokenizer, hf) -> None:
    for text in CORPUS:
        assert tok.encode(text) == hf(text)["input_ids"], text
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"], text


def test_decode_matches_transformers(tok: Tokenizer, hf) -> None:
    for text in CORPUS:
        ids = hf(text)["input_ids"]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


def test_special_tokens_and_vocab(tok: Tokenizer, hf) -> None:
    assert tok.bos_token == hf.bos_token
    assert tok.eos_token == hf.eos_token
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.eos_token_id == hf.eos_token_id
    assert tok.vocab_size == len(hf) == 49152
    # Every named special token transformers knows is skipped on decode by ours too.
    assert set(hf.all_special_ids) <= set(tok.all_special_ids)
    assert tok.decode(tok.all_special_ids) == ""
    assert tok.chat_template == hf.chat_template
    assert max(tok.encode("".join(CORPUS))) < tok.vocab_size


def _variant(src: Path, dst: Path, edit_tokenizer=None, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    if edit_tokenizer:
        data = json.loads((dst / "tokenizer.json").read_text())
        edit_tokenizer(data)
        (dst / "tokenizer.json").write_text(json.dumps(data))
    if edit_config:
        data = json.loads((dst / "tokenizer_config.json").read_text())
        edit_config(data)
        (dst / "tokenizer_config.json").write_text(json.dumps(data))
    return dst


def _add_bos_post_processor(data: dict) -> None:
    # Llama-3 style: the tokenizer.json post-processor prepends BOS.
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }


@pytest.mark.parametrize(
    "name, edit_tokenizer, edit_config",
    [
        ("bos-post-processor", _add_bos_post_processor, None),
        ("add-bos-flag", None, lambda c: c.update(add_bos_token=True, add_eos_token=True)),
        ("no-post-processor", lambda t: t.update(post_processor=None), lambda c: c.update(add_bos_token=True)),
        # A special token the vocabulary lacks is added (with a new id) on load.
        ("new-special", None, lambda c: c.update(eos_token="<|my_eos|>", extra_special_tokens=["<|extra|>"])),
    ],
)
def test_bos_and_special_token_variants(tmp_path: Path, default_model_dir: Path, name, edit_tokenizer, edit_config) -> None:
    transformers = pytest.importorskip("transformers")
    d = _variant(default_model_dir, tmp_path / name, edit_tokenizer, edit_config)
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    ours = Tokenizer.from_dir(d)
    texts = [*CORPUS[:12], "end <|my_eos|> and <|extra|> tokens"]
    for text in texts:
        assert ours.encode(text) == ref(text)["input_ids"], (name, text)
        ids = ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), (name, text)
    assert ours.vocab_size == len(ref)
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.bos_token_id == ref.bos_token_id
    if name == "bos-post-processor":
        assert ours.encode("hi")[0] == 0 and ours.encode("hi", add_special_tokens=False)[0] != 0
