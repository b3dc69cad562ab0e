"""The Qwen3.5 MTP head drafts what a plain re-implementation of the head (HF transformers' own
decoder layer and norms over the checkpoint's ``mtp.*`` tensors) predicts: the first draft from
the target's hidden states and the sampled token, the later ones from the head's own output."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TinyQwen3_5
from tokenline.model.batch import ScheduledBatch, ScheduledSeq
from tokenline.model.runner import ModelRunner
from tokenline.sampling_params import SamplingParams

NUM_DRAFTS = 3


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_5: TinyQwen3_5) -> Path:
    return tiny_qwen3_5(mtp_layers=1)


def reference_drafts(model_dir: Path, prompt: list[int], num_drafts: int) -> tuple[int, list[int]]:
    """(the target's greedy token after ``prompt``, the head's drafts after it), the head written
    out from HF modules: norms, [embedding | hidden] -> fc, the decoder layer over the whole row
    sequence (causal), the final norm, the tied LM head."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    config = model.config
    weights = {k.removeprefix("mtp."): v for k, v in load_file(str(model_dir / "model.safetensors")).items()
               if k.startswith("mtp.")}
    layer = Qwen3_5DecoderLayer(config, config.layer_types.index("full_attention")).eval()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in weights.items() if k.startswith("layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(weights[f"{name}.weight"])
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    fc.weight.data.copy_(weights["fc.weight"])
    embed = model.get_input_embeddings()

    def rows(tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        e = norms["pre_fc_norm_embedding"](embed(torch.tensor(tokens)))
        return fc(torch.cat([e, norms["pre_fc_norm_hidden"](hidden)], dim=-1))

    with torch.inference_mode():
        ids = torch.tensor([prompt])
        target = model.model(input_ids=ids).last_hidden_state[0]  # after the final norm
        token = int(model.lm_head(target[-1]).argmax())
        x = rows([*prompt[1:], token], target)  # row p: hidden at p, token at p + 1
        drafts: list[int] = []
        for _ in range(num_drafts):
            positions = torch.arange(x.shape[0])[None]
            cos_sin = model.model.rotary_emb(x[None], positions)
            out = norms["norm"](layer(x[None], position_embeddings=cos_sin, position_ids=positions)[0])
            drafts.append(int(model.lm_head(out[-1]).argmax()))
            x = torch.cat([x, rows([drafts[-1]], out[-1:])])  # the head on its own output, one on
    return token, drafts


def test_drafts_match_the_head_written_out_with_hf_modules(model_dir: Path) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(0, 248000) for _ in range(13)]
    runner = ModelRunner(model_dir, torch.float32, mtp_speculative_tokens=NUM_DRAFTS)
    runner.allocate_kv_cache(num_blocks=8, block_size=4, num_state_slots=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=8).with_defaults()
    # Blocks for the prompt and the head's drafts past it (the scheduler's look-ahead).
    seq = ScheduledSeq("r", prompt, 0, [0, 1, 2, 3, 4], True, greedy, prompt_token_ids=prompt, state_slot=0)
    sampled = runner.execute(ScheduledBatch([seq]))["r"]
    assert (sampled.token_id, sampled.next_draft_token_ids) == reference_drafts(model_dir, prompt, NUM_DRAFTS)
