"""Whether a checkpoint can serve ``--speculative mtp``: a model family with an MTP head, a config
that states one, and its ``mtp.*`` weights in the safetensors.

Torch-free (the safetensors headers are read as JSON), so ``serve`` refuses a model without an MTP
head with one line before any engine process starts; the loader checks the same way.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tokenline.model.config import ModelConfig

# Architectures whose module implements the MTP head (model/qwen3_5.py).
MTP_ARCHITECTURES = frozenset({"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"})


def mtp_num_layers(config: ModelConfig) -> int:
    """MTP layers the config states (``mtp_num_hidden_layers``; DeepSeek-style ``num_nextn_predict_layers``)."""
    raw = config.raw
    return int(raw.get("mtp_num_hidden_layers") or raw.get("num_nextn_predict_layers") or 0)


def tensor_names(model_dir: Path) -> list[str]:
    """Every tensor name in the directory's safetensors files, from their headers alone."""
    names: list[str] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        names.extend(name for name in header if name != "__metadata__")
    return names


def check_mtp_checkpoint(model_dir: Path, config: ModelConfig | None = None) -> int:
    """The number of MTP layers, or ValueError saying why this checkpoint cannot draft with MTP."""
    config = config or ModelConfig.from_dir(model_dir)
    if config.architecture not in MTP_ARCHITECTURES or not config.is_hybrid:
        raise ValueError(
            f"--speculative mtp needs a hybrid Qwen3.5-class model with an MTP head; "
            f"{config.architecture} has none (use --speculative ngram)"
        )
    num_layers = mtp_num_layers(config)
    if not num_layers:
        raise ValueError(
            f"--speculative mtp: {model_dir}/config.json states no MTP head (mtp_num_hidden_layers is 0 or absent)"
        )
    if not any(name.startswith("mtp.") for name in tensor_names(model_dir)):
        raise ValueError(
            f"--speculative mtp: the checkpoint in {model_dir} has no mtp.* weights (its config names "
            f"{num_layers} MTP layer(s), but they were stripped from the weights); use --speculative ngram"
        )
    return num_layers
