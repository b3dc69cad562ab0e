"""Several hybrid sequences' prefill spans through one Gated DeltaNet layer: one after another
(``_prefill`` per span, as before) against one batched call (``_prefill_batched``: one conv, one
padded chunked rule). The layer's own work only (its input projection is one matmul either way),
on a layer of the tiny test model's shape and one of Qwen3.5-27B's, random weights, float32, CPU.
Reports process CPU seconds per call (the machine may be shared: wall time includes others' turns).

    .venv/bin/python bench/hybrid_batched_prefill.py
    .venv/bin/python bench/hybrid_batched_prefill.py --spans 8 --tokens 100 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tokenline.model.prefill_attention import PrefillSpan  # noqa: E402
from tokenline.model.config import ModelConfig  # noqa: E402
from tokenline.model.gated_deltanet import GatedDeltaNet  # noqa: E402

SHAPES = {
    "tiny": {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
             "linear_value_head_dim": 32, "hidden_size": 128},
    "27b": {"linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "hidden_size": 5120},
}


def layer_of(shape: dict[str, int]) -> GatedDeltaNet:
    raw = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "num_hidden_layers": 1,
        "layer_types": ["linear_attention"], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "vocab_size": 1024, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4, **shape,
    }
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = GatedDeltaNet(ModelConfig.from_dict(raw))
    layer = layer.to_empty(device="cpu")
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.02)
    return layer


def measure(shape_name: str, spans: int, tokens: int, repeat: int) -> dict[str, float | int | str]:
    layer = layer_of(SHAPES[shape_name])
    total = spans * tokens
    gen = torch.Generator().manual_seed(1)
    mixed = torch.randn(total, layer.conv_dim, generator=gen)
    g = -torch.rand(total, layer.num_v_heads, generator=gen)
    beta = torch.rand(total, layer.num_v_heads, generator=gen)
    state = layer.make_state(spans, torch.float32, torch.device("cpu"))
    meta = [PrefillSpan(b * tokens, tokens, tokens, torch.zeros(1, dtype=torch.long), b) for b in range(spans)]
    core = torch.empty(total, layer.num_v_heads, layer.head_v_dim)

    def one_by_one() -> None:
        for span in meta:
            rows = slice(span.start, span.start + span.num_tokens)
            layer._prefill(mixed[rows], g[rows], beta[rows], span, state, core[rows])

    def together() -> None:
        layer._prefill_batched(mixed, g, beta, meta, state, core)

    result: dict[str, float | int | str] = {"shape": shape_name, "spans": spans, "tokens_per_span": tokens}
    with torch.inference_mode():
        for name, run in (("one_by_one", one_by_one), ("batched", together)):
            run()  # warm-up
            cpu = time.process_time()
            for _ in range(repeat):
                run()
            result[f"{name}_cpu_ms"] = round((time.process_time() - cpu) / repeat * 1000, 2)
    result["speedup"] = round(float(result["one_by_one_cpu_ms"]) / float(result["batched_cpu_ms"]), 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a fair count on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for shape in SHAPES:
        print(json.dumps(measure(shape, args.spans, args.tokens, args.repeat)), flush=True)


if __name__ == "__main__":
    main()
