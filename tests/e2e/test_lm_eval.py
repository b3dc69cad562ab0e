"""lm-evaluation-harness (``lm-eval``, its ``local-completions`` backend, as the README documents it)
against a real tokenline server: a log-likelihood task (multiple choice) and a ``generate_until``
task from local task files and a local dataset, with no hub access. The log-likelihoods lm-eval
records equal HF transformers' on the same model.

lm-eval scores a choice with one completions request (``echo``, ``logprobs: 1``, ``max_tokens: 1``)
whose prompt is context + continuation as token ids, and sums the prompt logprobs of the
continuation's tokens."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.e2e.conftest import Server

MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-3  # nats

CHOICE_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit"], "answer": 0},
]
GENERATE_DOCS = [
    {"question": "The capital of France is", "answer": "Paris"},
    {"question": "The first three colours of the rainbow are", "answer": "red"},
]
UNTIL = ["\n", "."]
MAX_GEN_TOKS = 8

pytestmark = pytest.mark.timeout(300)


def write_tasks(folder: Path) -> None:
    """Two task files and their JSON-lines datasets, read through the ``json`` dataset builder."""
    for name, docs in (("choices", CHOICE_DOCS), ("generate", GENERATE_DOCS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = {"dataset_path": "json", "test_split": "test"}
    tasks = {
        "tokenline_choices": {
            **common,
            "dataset_kwargs": {"data_files": {"test": str(folder / "choices.jsonl")}},
            "output_type": "multiple_choice",
            "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        },
        "tokenline_generate": {
            **common,
            "dataset_kwargs": {"data_files": {"test": str(folder / "generate.jsonl")}},
            "output_type": "generate_until",
            "doc_to_text": "{{question}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        },
    }
    for name, task in tasks.items():
        # YAML is a superset of JSON: a JSON object is a valid task file.
        (folder / f"{name}.yaml").write_text(json.dumps({"task": name, **task}, indent=1))


# lm-eval's Python API in a process of its own, so that the hub stays off from its first import
# (the variables below are read then). Only the local task files are indexed, not lm-eval's
# 14,000 built-in ones, which the command line scans first (~7 s of CPU).
RUNNER = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

folder, model_args = sys.argv[1], json.loads(sys.argv[2])
results = lm_eval.simple_evaluate(
    model="local-completions", model_args=model_args, tasks=["tokenline_choices", "tokenline_generate"],
    task_manager=TaskManager(include_path=folder, include_defaults=False), batch_size=8, log_samples=True,
    bootstrap_iters=0,
)
with open(f"{folder}/samples.json", "w") as out:
    json.dump(results["samples"], out, default=str)
"""


@pytest.fixture(scope="module")
def samples(server: Server, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lm-eval's logged samples per task (``log_samples``), scored through the server."""
    folder = tmp_path_factory.mktemp("lm_eval")
    write_tasks(folder)
    model_args = {
        "base_url": f"{server.api_url}/completions", "model": MODEL, "tokenizer_backend": "huggingface",
        "tokenizer": str(default_model_dir), "tokenized_requests": True, "max_retries": 1,
    }
    # Nothing may reach a hub: the tokenizer and the data are local files.
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(folder / "datasets")}
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", RUNNER, str(folder), json.dumps(model_args)],
                         env={**os.environ, **offline}, capture_output=True, text=True, timeout=240, cwd=folder)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    print(f"lm-eval run: {time.monotonic() - started:.1f} s")
    found = json.loads((folder / "samples.json").read_text())
    assert set(found) == {"tokenline_choices", "tokenline_generate"}, found.keys()
    return found


@pytest.fixture(scope="module")
def hf(default_model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(default_model_dir)


def reference_loglikelihood(hf: tuple[Any, Any], context: str, continuation: str) -> tuple[float, bool]:
    """log P(continuation | context) by transformers, tokenized as lm-eval does (the continuation's
    tokens are those of context + continuation after the context's), and whether it is greedy."""
    model, tokenizer = hf
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    with torch.inference_mode():
        logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(dim=-1)
    positions = range(len(context_ids), len(whole))
    total = sum(logprobs[p - 1, whole[p]].item() for p in positions)
    greedy = all(int(logprobs[p - 1].argmax()) == whole[p] for p in positions)
    return total, greedy


def test_loglikelihoods_equal_transformers(samples: dict[str, Any], hf: tuple[Any, Any]) -> None:
    docs = samples["tokenline_choices"]
    assert len(docs) == len(CHOICE_DOCS)
    worst = 0.0
    for doc in docs:
        assert [continuation for _, continuation in doc["arguments"]] == [" " + c for c in doc["doc"]["choices"]]
        for (context, continuation), response in zip(doc["arguments"], doc["resps"]):
            loglikelihood, greedy = response[0]
            expected, expected_greedy = reference_loglikelihood(hf, context, continuation)
            worst = max(worst, abs(loglikelihood - expected))
            assert abs(loglikelihood - expected) < TOLERANCE, (context, continuation, loglikelihood, expected)
            assert greedy == expected_greedy
    print(f"lm-eval log-likelihoods vs transformers: max abs diff {worst:.2e} nats")  # the benchmark report's figure (docs/benchmarks)
    assert [doc["acc"] for doc in docs] == [1.0, 1.0]  # the model knows these


def test_generate_until_produces_the_greedy_text(samples: dict[str, Any], server: Server) -> None:
    docs = samples["tokenline_generate"]
    assert len(docs) == len(GENERATE_DOCS)
    for doc in docs:
        text = doc["resps"][0][0]
        assert text.strip() and not any(stop in text for stop in UNTIL)
        # What the server answers the same prompt greedily, cut at the first stop string.
        body = {"model": MODEL, "prompt": doc["doc"]["question"], "max_tokens": MAX_GEN_TOKS, "temperature": 0}
        greedy = httpx.post(f"{server.api_url}/completions", json=body, timeout=120).json()["choices"][0]["text"]
        assert text == re.split("|".join(map(re.escape, UNTIL)), greedy)[0]
