"""Dense Qwen3 vs the transformers reference on a tiny random model, through the paged KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.model.test_qwen3_5 import BLOCK_SIZE, Seq, Step
from tokenline.model.config import ModelConfig
from tokenline.model.qwen3 import Qwen3ForCausalLM
from tokenline.model.random_models import make_qwen3_tiny
from tokenline.model.weights import iter_safetensors, load_packed_weights

NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_tiny")
    make_qwen3_tiny(path, seed=0)
    return path


def test_prefill_and_decode_match_reference(model_dir: Path) -> None:
    from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

    config = ModelConfig.from_dir(model_dir)
    model = Qwen3ForCausalLM(config)
    load_packed_weights(model, iter_safetensors(model_dir))
    model.eval()
    reference: Any = HFQwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    caches = model.make_caches(NUM_BLOCKS, BLOCK_SIZE, 0, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    a = Seq(torch.randint(0, config.vocab_size, (21 + 3,), generator=gen).tolist(), slot=0)
    b = Seq(torch.randint(0, config.vocab_size, (8 + 3,), generator=gen).tolist(), slot=1)
    with torch.inference_mode():
        want_a = reference(torch.tensor([a.token_ids])).logits[0]
        want_b = reference(torch.tensor([b.token_ids])).logits[0]

    step = Step()
    got_a, got_b = step.run(model, caches, [(a, 21), (b, 8)])  # type: ignore[arg-type]
    torch.testing.assert_close(got_a, want_a[:21], atol=1e-4, rtol=0)
    torch.testing.assert_close(got_b, want_b[:8], atol=1e-4, rtol=0)
    for i in range(3):
        got_a, got_b = step.run(model, caches, [(a, 1), (b, 1)])  # type: ignore[arg-type]
        torch.testing.assert_close(got_a[0], want_a[21 + i], atol=1e-4, rtol=0)
        torch.testing.assert_close(got_b[0], want_b[8 + i], atol=1e-4, rtol=0)
